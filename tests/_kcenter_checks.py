"""Comparison of two greedy k-center traversals whose arithmetic differs only by rounding.

Two implementations (readable NumPy, compiled twin, the mirror's array path, a float32 run)
compute the same Gram-identity distances ``|x|^2 - 2 <x, c> + |c|^2`` with different
summation orders, vector widths and FMA use, which also change with the CPU. A pick is a
discrete output: it is the same in both only where the farthest point is ahead of every
other distinct point by more than the two runs' rounding. So the picks are compared while
an exact walk (float64 explicit differences, after a power-of-two rescaling) certifies
them; at the first pick that differs, both picks must be near-optimal within the rounding
bound and distinct points (identical points get identical distances in every
implementation, so their tie goes to the lowest index in both), and the runs part ways
there.

Rounding bound of one squared distance by the Gram identity in precision ``eps``, with
``M`` the largest ``|x|^2`` among the points and centres: each of ``|x|^2``, ``<x, c>``,
``|c|^2`` is a sum of ``d`` products (error <= ``d eps M / 2`` each) and three more
roundings of values <= ``4 M``, so <= ``(2 d + 6) eps M``; the radii, ``|x|^2`` stored in
the input dtype and ``sqrt`` add a few ``eps M``. :data:`FACTOR` doubles it:
``sq_tol = 4 (d + 3) eps M`` per run, ``2 sq_tol`` between two runs.

:func:`pick_leads` certifies picks between runs whose inputs differ (a CPU and a GPU run of
a model): the same picks while each pick leads the next candidate by more than four times
the largest move of a point.

:func:`sequential_traversal` is the CUDA kernels' arithmetic without FMA, in NumPy: under
Numba's simulator their picks and radii must equal it bit for bit.
"""

from __future__ import annotations

import numpy as np

FACTOR = 4.0


def _exact_sq(points, center):
    return np.sum((points - center) ** 2, axis=1)


def assert_same_traversal(a, b, points, *, initial=None, dtype=None):
    """``a``, ``b``: KCenterResult of one traversal of ``points`` (NumPy arrays).

    ``initial``: None, row indices or centre coordinates (as passed to both); ``dtype``:
    the precision of the less precise run (default: the points' dtype).
    """
    points = np.asarray(points, dtype=np.float64)
    n, d = points.shape
    eps = float(np.finfo(dtype or np.float64).eps)
    centres = np.empty((0, d))
    marked = np.empty(0, dtype=np.int64)
    if initial is not None:
        initial = np.asarray(initial)
        if initial.ndim == 1 and np.issubdtype(initial.dtype, np.integer):
            marked = np.unique(initial % n)
            centres = points[marked]
        else:
            centres = np.asarray(initial, dtype=np.float64)
    top = float(np.max(np.abs(np.concatenate([points.ravel(), centres.ravel()]))))
    scale = 2.0 ** np.floor(np.log2(top)) if top > 0.0 else 1.0      # exact
    x, c = points / scale, centres / scale
    m = float(np.max(np.sum(np.concatenate([x, c]) ** 2, axis=1)))
    sq_tol = FACTOR * (d + 3) * eps * m                               # one run's bound

    def sq(r):
        return (np.asarray(r, dtype=np.float64) / scale) ** 2

    min_sq = np.full(n, np.inf)
    for centre in c:
        min_sq = np.minimum(min_sq, _exact_sq(x, centre))
    min_sq[marked] = -np.inf
    if initial is not None:
        exact = max(float(np.max(min_sq)), 0.0)
        for run in (a, b):
            assert abs(sq(run.initial_radius) - exact) <= sq_tol, "initial radius"
    assert a.indices.shape == b.indices.shape
    for t, (p, q) in enumerate(zip(a.indices.tolist(), b.indices.tolist())):
        if p != q:
            best = float(np.max(min_sq))
            assert best < np.inf, f"first pick differs ({p} vs {q}): the same draw of rng"
            assert min_sq[p] >= best - 2 * sq_tol and min_sq[q] >= best - 2 * sq_tol, (
                f"pick {t} differs ({p} vs {q}) without a near-tie: squared distances "
                f"{min_sq[p]:.17g}, {min_sq[q]:.17g}, farthest {best:.17g}, bound {sq_tol:.3g}")
            assert not np.array_equal(points[p], points[q]), (
                f"pick {t}: identical points {p} and {q} picked in different orders")
            return t
        min_sq = np.minimum(min_sq, _exact_sq(x, x[p]))
        min_sq[p] = -np.inf
        exact = max(float(np.max(min_sq)), 0.0)
        for run in (a, b):
            err = abs(sq(run.radii[t]) - exact)
            assert err <= sq_tol, f"radius {t}: squared error {err:.3g} > {sq_tol:.3g}"
    return len(a.indices)


def pick_leads(points, k, initial):
    """The lead of each of the ``k`` picks of the exact traversal from centres ``initial``:
    the farthest point's distance to the centres minus the next farthest's (float64
    explicit differences; ``inf`` where no other candidate is left).

    Distances are 1-Lipschitz in the points and the centres, so a traversal of inputs that
    each moved by at most ``delta`` (any arithmetic, any device) makes the same picks while
    every lead exceeds ``4 delta``: each distance moves by at most ``2 delta``.
    """
    points = np.asarray(points, dtype=np.float64)
    n = points.shape[0]
    dist = np.full(n, np.inf)
    for centre in np.asarray(initial, dtype=np.float64).reshape(-1, points.shape[1]):
        dist = np.minimum(dist, np.sqrt(_exact_sq(points, centre)))
    leads = []
    for _ in range(k):
        order = np.argsort(-dist, kind="stable")          # ties: the lowest index first
        p = order[0]
        runner_up = dist[order[1]] if n > 1 else -np.inf
        leads.append(dist[p] - runner_up if runner_up > -np.inf else np.inf)
        dist = np.minimum(dist, np.sqrt(_exact_sq(points, points[p])))
        dist[p] = -np.inf
    return np.array(leads)


def sequential_traversal(points, k, min_sq, first=None):
    """The traversal in the arithmetic of :mod:`refdml.gpu.kcenter._cuda`'s kernels
    without FMA (what Numba's CUDA simulator computes), written independently in NumPy:
    ``|x_i|^2`` and every dot product are float64 products summed in coordinate order (one
    rounding per operation, vectorised over the points only), ``|x_i|^2`` and ``m`` are
    stored in the points' dtype, the distance is ``max(|x_i|^2 - 2 <x_i, x_q> + |x_q|^2, 0)``
    and the arg-max takes the lowest index among equal values.

    points : (n, d) float32/float64 (already scaled); min_sq : (n,) the starting squared
    distances in the points' dtype (``inf`` without centres, ``-1`` at centres); first : the
    first pick, or None for ``argmax(min_sq)``. Returns ``(indices, radii)`` as the kernels'
    caller does: int64, and ``sqrt(max(radius^2, 0))`` in float64 rounded to the dtype.
    """
    dtype = points.dtype
    x = points.astype(np.float64)
    n, d = x.shape
    acc = np.zeros(n)
    for j in range(d):
        acc = acc + x[:, j] * x[:, j]
    sq_norms = acc.astype(dtype).astype(np.float64)
    m = np.asarray(min_sq, dtype=dtype).copy()
    q = int(np.argmax(m)) if first is None else int(first)
    indices, radii_sq = [], []
    for _ in range(k):
        indices.append(q)
        dot = np.zeros(n)
        for j in range(d):
            dot = dot + x[:, j] * x[q, j]
        value = sq_norms - 2.0 * dot + sq_norms[q]
        dist = np.where(value > 0.0, value, 0.0)
        current = m.astype(np.float64)
        new = np.where(dist < current, dist, current)
        new[q] = -1.0
        m = new.astype(dtype)
        q = int(np.argmax(m))
        radii_sq.append(float(m[q]))
    radii = np.sqrt(np.maximum(np.array(radii_sq), 0.0)).astype(dtype)
    return np.array(indices, dtype=np.int64), radii
