r"""Independent JAX implementations of two refdml operators, correct and deliberately broken.

The conformance tests hold them to the reference with
:func:`refdml.conformance.check_implementation`: the correct ones must pass, each broken
one must fail with the cause and at the place its defect predicts. They are written from
the papers and from refdml's documentation (docs/gsp.md, docs/ot.md, docs/corrections.md),
not from its code, and call nothing in refdml: an implementation that shared the
reference's code would agree with it by construction.

GSP pooling layer (Alg. 2, Eqs. 4.1 and 4.3), ``gsp_pool(features (B, n, d), prototypes
(m, d), mu=, inverse_temperature=, p=1)`` -> ``(pooled (B, d), z (B, m))``:
cost ``c_ij = ||wbar_i - fbar_j||`` of the points clipped to the unit ball; (P2) reduced
to one scalar equation per image (docs/gsp.md Sec. 2): with ``l_j = logsumexp_i(-eps
c_ij)``, ``x_j = tau + l_j`` and ``(1/n) sum_j sigma(x_j) = mu``,
``rho_j = sigma(-x_j) / n`` and ``pi_ij = sigma(x_j) softmax_i(-eps c_.j) / n``. The root is
bracketed and bisected to the last bit without gradient, in the coordinates of the
feature whose logit is nearest 0 (so that ``eps`` up to 1e300 costs no digits); the logits
then carry the implicit derivative ``dtau = -sum_j sigma'_j dl_j / sum_j sigma'_j`` as a
custom JVP, and ``jax.vjp`` differentiates the rest (cost map, softmax, pooling).
``pooled = (mean_j (w_j f_j)^p)^(1/p)`` with ``w_j = n sum_i pi_ij / mu`` (= ``(1 - n
rho_j) / mu`` on the column constraint, without its cancellation at small ``mu``),
``z_i = sum_j pi_ij / mu``. Broken twins: (P2)'s backward as the printed Eq. (4.2) read
literally (``gsp_pool_printed_42``), the norms as ``sqrt(sum v^2)`` (``gsp_pool_naive_norm``).

Sinkhorn divergence (Wasserstein DML Eq. 4), ``sinkhorn_divergence(x (n, d), y (m, d),
a=None, b=None, eps=, p=2)``: ``OT(a, b) - (OT(a, a) + OT(b, b)) / 2`` with ``OT`` the
regularised value ``min <pi, C> + eps KL(pi | a x b)``, ``C = ||x - y||^p``, weights
normalised to sum 1. Log-domain Sinkhorn (alternating for the cross problem, the averaged
update for the symmetric ones) with a short eps-annealing start, run without gradient to a
marginal error ``tol``; the value is the dual objective at those potentials, differentiated
by JAX with the potentials held fixed (the envelope theorem: the dual's gradient in the
potentials is 0 at the optimum). Broken twins: without the self terms
(``..._not_debiased``), stopped at a marginal error of 1e-3 (``..._stopped_early``), every
cost as ``sqrt(.)^p`` (``..._sqrt_cost``: NaN gradient at the self terms' zero diagonal),
the cross cost alone as ``sqrt(.)^p`` (``..._nan_at_coincident``: NaN only where a point of
x is a point of y).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "gsp_pool",
    "gsp_pool_naive_norm",
    "gsp_pool_printed_42",
    "sinkhorn_divergence",
    "sinkhorn_divergence_nan_at_coincident",
    "sinkhorn_divergence_not_debiased",
    "sinkhorn_divergence_sqrt_cost",
    "sinkhorn_divergence_stopped_early",
]

# Halvings of the (P2) bracket, at most 4096 wide (see _roots): 200 reach adjacent
# floating-point numbers.
_BISECTIONS = 200
# Hyperparameters that steer Python control flow are compiled in (one compilation per value
# and shape); the temperatures are traced, so the hard cases that vary them share one.
_GSP_STATIC = ("mu", "p", "method", "max_iter", "tol", "backward")
_SD_STATIC = ("p", "value", "max_iter", "tol", "eps_scaling")


# ------------------------------------------------------------------------------------------
# Norms


def _norm(v, axis=-1):
    """``||v||`` along ``axis`` with gradient 0 at ``v = 0`` (the subgradient the reference
    uses) and no underflow of the squares of tiny vectors (divided by their largest entry)."""
    scale = lax.stop_gradient(jnp.max(jnp.abs(v), axis=axis, keepdims=True))
    scale = jnp.where(scale > 0, scale, 1)
    sq = jnp.sum((v / scale) ** 2, axis=axis)
    positive = sq > 0
    return jnp.where(positive, jnp.squeeze(scale, axis) * jnp.sqrt(jnp.where(positive, sq, 1)), 0)


def _naive_norm(v, axis=-1):
    # Broken on purpose: d sqrt(s) / ds is infinite at s = 0, times d s = 0 gives NaN.
    return jnp.sqrt(jnp.sum(v * v, axis=axis))


# ------------------------------------------------------------------------------------------
# GSP


def _clip(u):
    """``u / max(1, ||u||)`` computed on ``u / s`` (``s`` its largest entry, held fixed: the
    map is homogeneous), so neither ``||u||^2`` nor the quotient rule's ``||u||^2`` over- or
    underflows at 1e200 or 1e-200."""
    scale = lax.stop_gradient(jnp.max(jnp.abs(u), axis=-1, keepdims=True))
    scale = jnp.where(scale > 0, scale, 1)
    v = u / scale
    return v / jnp.maximum(_norm(v)[..., None], 1 / scale)


def _naive_clip(u):
    return u / jnp.maximum(_naive_norm(u)[..., None], 1)


def _gsp_cost(features, prototypes, naive=False):
    """``c[b, i, j] = ||wbar_i - fbar_{b, j}||`` (B, m, n)."""
    clip, norm = (_naive_clip, _naive_norm) if naive else (_clip, _norm)
    w_bar, f_bar = clip(prototypes), clip(features)
    return norm(w_bar[None, :, None, :] - f_bar[:, None, :, :])


# Half-width of the window the (P2) root is looked for in, in a pivot's coordinates: beyond
# |x| ~ 745 every sigmoid is exactly 0 or 1 in float64.
_WINDOW = 2048.0


@jax.jit
def _roots(relative, mu):
    """``Y[b, q]`` with ``mean_j sigma(Y[b, q] + relative[b, q, j]) = mu``, bisected to the
    last bit inside ``[-_WINDOW, _WINDOW]`` (clamped to it where the root lies beyond)."""
    logit = jnp.log(mu) - jnp.log1p(-mu)
    # Every sigmoid is <= mu at logit - max_j relative, >= mu at logit - min_j relative.
    low = jnp.clip(logit - jnp.max(relative, axis=2), -_WINDOW, _WINDOW)
    high = jnp.clip(logit - jnp.min(relative, axis=2), -_WINDOW, _WINDOW)

    def halve(_, bracket):
        low, high = bracket
        middle = 0.5 * (low + high)
        below = jnp.mean(jax.nn.sigmoid(middle[..., None] + relative), axis=2) < mu
        return jnp.where(below, middle, low), jnp.where(below, high, middle)

    low, high = lax.fori_loop(0, _BISECTIONS, halve, (low, high))
    return 0.5 * (low + high)


@jax.custom_jvp
def _softmax(z):
    """``softmax`` over axis 1 of ``z`` (B, m, n); its derivative applied through the
    Jacobian's entries ``A_i (delta_ik - A_k)``, each exactly 0 for a one-hot column."""
    return jax.nn.softmax(z, axis=1)


@_softmax.defjvp
def _softmax_jvp(primals, tangents):
    # Why not JAX's own rule, A (dz - <A, dz>): XLA may recompute the two dz's in separate
    # fusions, rounded differently, and their difference times eps = 1e300 is ~1e283
    # where the gradient is exactly 0. A zero coefficient is zero whatever it multiplies.
    (z,), (dz,) = primals, tangents
    a = _softmax(z)
    m = z.shape[1]
    jacobian = a[:, :, None, :] * (jnp.eye(m, dtype=z.dtype)[None, :, :, None] - a[:, None, :, :])
    return a, jnp.einsum("bikj,bkj->bij", jacobian, dz)


@jax.custom_jvp
def _implicit_logits(r, root, share):
    """``root + r`` (B, n), with ``root`` the (P2) root for ``r``: the tangent is the implicit
    one, ``dx_i = dr_i - sum_k share_k dr_k``, applied through its coefficients ``delta_ik -
    share_k`` (exactly 0 where one feature carries all of sigma', whatever XLA fuses)."""
    return root[:, None] + r


@_implicit_logits.defjvp
def _implicit_logits_jvp(primals, tangents):
    r, root, share = primals
    n = r.shape[1]
    coefficients = jnp.eye(n, dtype=r.dtype)[None] - share[:, None, :]
    return root[:, None] + r, jnp.einsum("bik,bk->bi", coefficients, tangents[0])


def _transport(cost, mu: float, inverse_temperature: float):
    """``(rho (B, n), pi (B, m, n))`` of (P2), differentiable in ``cost`` by autodiff.

    Nothing forms ``exp(-eps c)`` or ``eps c`` itself (0 and overflow at eps = 1e300): the
    logits are ``x_j = y + r_j`` in the coordinates of a pivot feature ``q``, ``r_j = l_j -
    l_q`` from cost differences, and the pivot is the feature whose logit is nearest 0 at
    the root, so that ``y`` is small and carries no rounding of ``eps c`` (docs/gsp.md
    Sec. 2). The root ``y`` is found without gradient; the logits carry the implicit
    derivative ``dy = -sum_k sigma'_k dr_k / sum_k sigma'_k`` (:func:`_implicit_logits`).
    """
    n = cost.shape[2]
    column_min = lax.stop_gradient(jnp.min(cost, axis=1))                  # (B, n)
    # Shifted by the column's minimum (softmax and logsumexp are shift-invariant), so the
    # largest entry is exp(0) and eps (c - cmin) = inf is a weight of exactly 0.
    shifted = -inverse_temperature * (cost - column_min[:, None, :])
    assignment = _softmax(shifted)
    if mu == 1.0:
        # Thm 4.1's limit tau = inf: every feature fully transported.
        return jnp.zeros(column_min.shape, cost.dtype), assignment / n
    lam = jax.nn.logsumexp(shifted, axis=1)                     # l_j + eps cmin_j, in [0, log m]
    gap = inverse_temperature * (column_min[:, None, :] - column_min[:, :, None])
    relative = (lam[:, None, :] - lam[:, :, None]) - gap        # [b, q, j] = l_j - l_q
    roots = _roots(lax.stop_gradient(relative), mu)             # (B, n), one per pivot q
    pivot = jnp.argmin(jnp.abs(roots), axis=1)
    r = jnp.take_along_axis(relative, pivot[:, None, None], axis=1)[:, 0, :]
    root = jnp.take_along_axis(roots, pivot[:, None], axis=1)[:, 0]
    sigma = jax.nn.sigmoid(root[:, None] + lax.stop_gradient(r))
    slope = sigma * (1 - sigma)
    total = jnp.sum(slope, axis=1, keepdims=True)
    share = jnp.where(total > 0, slope / jnp.where(total > 0, total, 1), 0)
    # Exactly 1 where one feature carries all of sigma' (XLA may divide by multiplying with
    # a reciprocal, 1 ulp off: times eps = 1e300 that is a gradient of 1e283, not 0).
    share = jnp.where(slope == total, 1, share)
    logits = _implicit_logits(r, root, share)
    rho = jax.nn.sigmoid(-logits) / n
    pi = (jax.nn.sigmoid(logits) / n)[:, None, :] * assignment
    return rho, pi


def _printed_42_backward(mu, residuals, cotangents):
    """GSP Eq. (4.2) read literally, ``n pi Diag(q - eta / kappa) rho`` (the bracket a vector,
    then times rho): docs/corrections.md item 1, wrong on purpose."""
    rho, pi, inverse_temperature = residuals
    d_rho, d_pi = cotangents
    n = rho.shape[1]
    q = rho * d_rho + jnp.sum(pi * d_pi, axis=1)
    eta = jnp.sum(rho * d_rho, axis=1) - n * jnp.sum(q * rho, axis=1)
    kappa = 1 - mu - n * jnp.sum(rho * rho, axis=1)
    inner = (q - (eta / kappa)[:, None]) * rho
    d_cost = -inverse_temperature * (pi * d_pi - n * pi * inner[:, None, :])
    return d_cost, jnp.zeros_like(inverse_temperature)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _transport_printed_42(cost, mu, inverse_temperature):
    return _transport(lax.stop_gradient(cost), mu, inverse_temperature)


def _transport_printed_42_forward(cost, mu, inverse_temperature):
    rho, pi = _transport(lax.stop_gradient(cost), mu, inverse_temperature)
    return (rho, pi), (rho, pi, inverse_temperature)


_transport_printed_42.defvjp(_transport_printed_42_forward, _printed_42_backward)


def _pool(features, prototypes, mu, inverse_temperature, p, transport, naive=False):
    n = features.shape[1]
    rho, pi = transport(_gsp_cost(features, prototypes, naive), mu, inverse_temperature)
    weights = n * jnp.sum(pi, axis=1) / mu                            # (B, n)
    weighted = weights[:, :, None] * features
    if p == 1:
        pooled = jnp.mean(weighted, axis=1)
    else:
        # Divided by each channel's largest term (held fixed: the power mean is homogeneous),
        # so (w f)^p neither overflows nor underflows to an all-zero mean at p = 1000.
        peak = lax.stop_gradient(jnp.max(weighted, axis=1, keepdims=True))
        peak = jnp.where(peak > 0, peak, 1)
        mean = jnp.mean((weighted / peak) ** p, axis=1)
        positive = mean > 0   # 0 on an all-zero channel, where (.)^(1/p) has no derivative
        pooled = jnp.where(positive, jnp.where(positive, mean, 1) ** (1.0 / p), 0) * peak[:, 0]
    return pooled, jnp.sum(pi, axis=2) / mu


@functools.partial(jax.jit, static_argnames=_GSP_STATIC)
def gsp_pool(features, prototypes, *, mu, inverse_temperature, p=1.0, method=None,
             max_iter=None, tol=None, backward=None):
    """The GSP layer, ``(pooled, z)``, with (P2) solved to the last bit and differentiated by
    JAX. ``method``, ``max_iter``, ``tol`` and ``backward`` (the reference's solver
    options) are accepted and ignored: this one always solves (P2) exactly."""
    return _pool(features, prototypes, mu, inverse_temperature, p, _transport)


@functools.partial(jax.jit, static_argnames=_GSP_STATIC)
def gsp_pool_printed_42(features, prototypes, *, mu, inverse_temperature, p=1.0, method=None,
                        max_iter=None, tol=None, backward=None):
    """Broken: the same forward, (P2)'s backward the printed Eq. (4.2) read literally."""
    return _pool(features, prototypes, mu, inverse_temperature, p, _transport_printed_42)


@functools.partial(jax.jit, static_argnames=_GSP_STATIC)
def gsp_pool_naive_norm(features, prototypes, *, mu, inverse_temperature, p=1.0, method=None,
                        max_iter=None, tol=None, backward=None):
    """Broken: the cost map's norm as ``sqrt(sum v^2)``, NaN gradient at a zero cost (a
    feature on a prototype) and at a zero feature or prototype."""
    return _pool(features, prototypes, mu, inverse_temperature, p, _transport, naive=True)


# ------------------------------------------------------------------------------------------
# Sinkhorn divergence


def _sq_distances(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)


def _cost(x, y, p):
    """``||x_i - y_j||^p`` with gradient 0 at coincident points (p < 2 has a kink there)."""
    sq = _sq_distances(x, y)
    if p == 2:
        return sq
    positive = sq > 0
    return jnp.where(positive, jnp.where(positive, sq, 1) ** (p / 2), 0)


def _sqrt_cost(x, y, p):
    # Broken on purpose: ||x - y|| first, then the power: NaN gradient where x_i == y_j.
    return jnp.sqrt(_sq_distances(x, y)) ** p


def _log_weighted_sum(t, w, axis):
    """``log sum_k w_k exp(t_k)`` along ``axis`` for weights ``w`` summing to 1.

    As ``max t + log1p(sum_k w_k expm1(t_k - max t))``: when every ``t`` is tiny (``eps``
    far above the costs, ``t = (g - C) / eps ~ 1e-6``) the plain log-sum-exp adds ``t`` to
    ``log w ~ -1`` and keeps only its first ~10 digits, which ``eps`` then multiplies.
    """
    peak = jnp.max(t, axis=axis, keepdims=True)
    rest = jnp.sum(w * jnp.expm1(t - peak), axis=axis)
    return jnp.squeeze(peak, axis) + jnp.log1p(rest)


@functools.partial(jax.jit, static_argnames=("symmetric", "anneal"))
def _potentials(cost, a, b, eps, tol, max_iter, *, symmetric, anneal=True):
    """``(n_iter, f, g, error)``: dual potentials of entropic OT by log-domain Sinkhorn.

    ``anneal``: the temperature starts at the largest cost and halves each iteration down
    to ``eps`` (warm starts: small eps converges in far fewer iterations). It stops once
    the L1 error of the row marginal (the columns hold exactly after a column update) is at
    most ``tol`` at ``eps``, or after ``max_iter`` iterations in all.
    """
    start = jnp.maximum(jnp.max(cost), eps) if anneal else eps

    def update_f(g, temperature):
        return -temperature * _log_weighted_sum((g[None, :] - cost) / temperature, b[None, :], 1)

    def update_g(f, temperature):
        return -temperature * _log_weighted_sum((f[:, None] - cost) / temperature, a[:, None], 0)

    def step(state):
        k, f, g, _ = state
        temperature = jnp.maximum(eps, start * 0.5 ** k)
        if symmetric:
            f = 0.5 * (f + update_f(f, temperature))
            g = f
        else:
            f = update_f(g, temperature)
            g = update_g(f, temperature)
        row_log_mass = _log_weighted_sum((f[:, None] + g[None, :] - cost) / eps, b[None, :], 1)
        error = jnp.sum(a * jnp.abs(jnp.expm1(row_log_mass)))
        error = jnp.where(temperature > eps, jnp.inf, error)
        return k + 1, f, g, error

    def unfinished(state):
        k, _, _, error = state
        return (k < max_iter) & (error > tol)

    zeros_f = jnp.zeros(cost.shape[0], cost.dtype)
    zeros_g = jnp.zeros(cost.shape[1], cost.dtype)
    inf = jnp.asarray(jnp.inf, cost.dtype)
    return lax.while_loop(unfinished, step, (0, zeros_f, zeros_g, inf))


def _entropic_ot(cost, a, b, eps, *, tol, max_iter, symmetric, anneal=True):
    """``OT_eps`` (regularised value) as the dual objective at fixed potentials.

    ``<a, f> + <b, g> - eps sum_ij a_i b_j (exp((f_i + g_j - C_ij) / eps) - 1)``, the last
    term with ``expm1`` (it is ~``eps`` times the marginal error, and so is its gradient
    in the weights: formed as a difference of ~1 and 1 it would be ``eps`` ulps).
    """
    # float32 cannot meet a float64 tolerance: stop at its own rounding floor.
    tol = max(tol, 64 * float(jnp.finfo(cost.dtype).eps))
    fixed = lax.stop_gradient
    _, f, g, _ = _potentials(fixed(cost), fixed(a), fixed(b), eps, tol, max_iter,
                             symmetric=symmetric, anneal=anneal)
    f, g = fixed(f), fixed(g)
    excess = jnp.sum(a[:, None] * b[None, :] * jnp.expm1((f[:, None] + g[None, :] - cost) / eps))
    return jnp.dot(a, f) + jnp.dot(b, g) - eps * excess


def _weights(w, size, dtype):
    if w is None:
        return jnp.full(size, 1.0 / size, dtype)
    return w / jnp.sum(w)


def _divergence(x, y, a, b, *, eps, p, value, max_iter, tol, cost=_cost, debiased=True,
                anneal=True):
    if value != "regularized":
        raise ValueError(f"value == {value!r}: only 'regularized' is implemented here")
    a, b = _weights(a, x.shape[0], x.dtype), _weights(b, y.shape[0], y.dtype)
    solve = functools.partial(_entropic_ot, eps=eps, tol=tol, max_iter=max_iter, anneal=anneal)
    cross = solve(cost(x, y, p), a, b, symmetric=False)
    if not debiased:
        return cross
    return cross - 0.5 * (solve(_cost(x, x, p), a, a, symmetric=True)
                          + solve(_cost(y, y, p), b, b, symmetric=True))


@functools.partial(jax.jit, static_argnames=_SD_STATIC)
def sinkhorn_divergence(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                        max_iter=1000, tol=1e-9, eps_scaling=None):
    """Eq. (4), the regularised value; ``eps_scaling`` accepted and ignored (annealing is
    built in)."""
    return _divergence(x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol)


@functools.partial(jax.jit, static_argnames=_SD_STATIC)
def sinkhorn_divergence_not_debiased(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                     max_iter=1000, tol=1e-9, eps_scaling=None):
    """Broken: ``OT(a, b)`` alone, without the self terms of Eq. (4)."""
    return _divergence(x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
                       debiased=False)


@functools.partial(jax.jit, static_argnames=_SD_STATIC)
def sinkhorn_divergence_stopped_early(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                      max_iter=1000, tol=1e-9, eps_scaling=None):
    """Broken: every Sinkhorn solve stopped at a marginal error of 1e-3, whatever ``tol``
    says (a loose default left in place)."""
    return _divergence(x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=1e-3)


@functools.partial(jax.jit, static_argnames=_SD_STATIC)
def sinkhorn_divergence_sqrt_cost(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                  max_iter=1000, tol=1e-9, eps_scaling=None):
    """Broken: every cost as ``sqrt(sum (x - y)^2) ** p``: a NaN gradient at every zero
    cost, which the self terms' diagonals always have."""
    a, b = _weights(a, x.shape[0], x.dtype), _weights(b, y.shape[0], y.dtype)
    solve = functools.partial(_entropic_ot, eps=eps, tol=tol, max_iter=max_iter)
    return solve(_sqrt_cost(x, y, p), a, b, symmetric=False) - 0.5 * (
        solve(_sqrt_cost(x, x, p), a, a, symmetric=True)
        + solve(_sqrt_cost(y, y, p), b, b, symmetric=True))


@functools.partial(jax.jit, static_argnames=_SD_STATIC)
def sinkhorn_divergence_nan_at_coincident(x, y, a=None, b=None, *, eps, p=2,
                                          value="regularized", max_iter=1000, tol=1e-9,
                                          eps_scaling=None):
    """Broken: the self terms right, the cross cost as ``sqrt(sum (x - y)^2) ** p``: finite
    gradients until a point of ``x`` coincides with one of ``y`` (a zero cross cost)."""
    return _divergence(x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
                       cost=_sqrt_cost)
