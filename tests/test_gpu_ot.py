"""refdml.gpu.ot beyond the parity suite: errors named, float32 at small eps, convergence
reported and warned, no re-solve in the backward."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import ot as reference
from refdml.exceptions import ConvergenceWarning
from refdml.gpu import _ot_sinkhorn
from refdml.gpu import ot as fast


def _problem(rng, n=6, m=5, dtype=np.float64):
    x, y = rng.standard_normal((n, 2)), rng.standard_normal((m, 2))
    cost = np.sum((x[:, None] - y[None]) ** 2, axis=-1)
    return (np.full(n, 1.0 / n, dtype), np.full(m, 1.0 / m, dtype), cost.astype(dtype))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(a=np.array([1.0, -1.0, 1, 1, 1, 1])), ValueError, "a must be positive"),
        (dict(b=np.ones(4)), ValueError, "b has 4 entries"),
        (dict(cost=np.full((6, 5), np.nan)), ValueError, "cost must be finite"),
        (dict(cost="abc"), TypeError, "cost"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(tol=-1.0), ValueError, "tol"),
        (dict(eps=1e-9), ValueError, "float32 the kernel"),
    ],
)
def test_bad_input_is_named(change, error, words):
    a, b, cost = _problem(np.random.default_rng(0), dtype=np.float32)
    args = dict(a=a, b=b, cost=cost, eps=0.1)
    args.update(change)
    with pytest.raises(error, match=words):
        fast.sinkhorn(**args)


def test_bad_upstream_and_context_are_named():
    clouds = np.random.default_rng(1).standard_normal((3, 4, 2)).astype(np.float32)
    sd, ctx = fast.pairwise_sinkhorn_divergence_forward(clouds, eps=0.5)
    with pytest.raises(TypeError, match="ctx"):
        fast.pairwise_sinkhorn_divergence_backward(object(), sd)
    with pytest.raises(ValueError, match="d_divergence has shape"):
        fast.pairwise_sinkhorn_divergence_backward(ctx, sd[:2])
    bad = np.array(sd)
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="d_divergence must be finite"):
        fast.pairwise_sinkhorn_divergence_backward(ctx, bad)
    with pytest.raises(ValueError, match="pairs must join two different images"):
        fast.wcontrastive_forward(clouds, [0, 1, 0], margin=1.0, eps=0.5, pairs=[[1, 1]])
    with pytest.raises(ValueError, match="labels has length"):
        fast.wtriplet_forward(clouds, [0, 1], margin=1.0, eps=0.5)


# Plan tolerance: the exponents C / eps carry a float32 rounding of ~u C / eps (6e-5 at
# 1e-3) and both solvers stop at a marginal error of 1e-6 on a nearly decoupled plan
# (docs/ot.md Sec. 2): the plans agree to ~5e-3 of their largest entry there.
@pytest.mark.parametrize("relative_eps, plan_tol", [(1e-2, 1e-4), (1e-3, 1e-2)])
def test_float32_finite_and_accurate_at_small_eps(relative_eps, plan_tol):
    """eps down to 1e-3 of the cost scale: finite float32 plan and potentials, the value of
    the float64 reference to float32 accuracy (with eps-scaling, as the docs advise)."""
    a, b, cost = _problem(np.random.default_rng(2), n=12, m=10)
    eps = relative_eps * float(cost.max())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        ref = reference.sinkhorn(a, b, cost, eps=eps, tol=1e-6, max_iter=5000, eps_scaling=0.5)
        got = fast.sinkhorn(a.astype(np.float32), b.astype(np.float32), cost.astype(np.float32),
                            eps=eps, tol=1e-6, max_iter=5000, eps_scaling=0.5)
    assert got.plan.dtype == np.float32 and np.all(np.isfinite(got.plan))
    assert np.all(np.isfinite(got.f)) and np.all(np.isfinite(got.g))
    assert got.converged
    assert_allclose(got.value, ref.value, rtol=1e-4)
    assert_allclose(got.plan, ref.plan, atol=plan_tol * float(ref.plan.max()))


def test_convergence_reported_and_warned():
    a, b, cost = _problem(np.random.default_rng(3))
    batch = np.stack([cost, 2 * cost])
    result = fast.sinkhorn(a, b, batch, eps=0.5, tol=1e-10)
    assert result.converged.shape == (2,) and result.converged.all()
    assert np.all(result.residual <= 1e-10) and np.all(result.n_iter > 0)
    with pytest.warns(ConvergenceWarning, match="max_iter=2"):
        stopped = fast.sinkhorn(a, b, cost, eps=0.01, tol=1e-10, max_iter=2)
    assert stopped.converged is False and stopped.n_iter == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        fixed = fast.sinkhorn(a, b, cost, eps=0.01, tol=0.0, max_iter=3)  # no warning
    assert fixed.n_iter == 3 and fixed.converged is False


def test_float32_tol_raised_to_the_floor():
    a, b, cost = _problem(np.random.default_rng(4), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        result = fast.sinkhorn(a, b, cost, eps=0.1, tol=1e-12, max_iter=5000)
    floor = _ot_sinkhorn.residual_floor(np.float32, 1.0 / (0.1 / float(cost.max())))
    assert result.converged and result.residual <= 2 * floor


def test_backward_does_not_resolve(monkeypatch):
    features = (0.3 * np.random.default_rng(5).standard_normal((4, 3, 2))).astype(np.float32)
    calls = []
    solve = _ot_sinkhorn.solve_batch
    monkeypatch.setattr(_ot_sinkhorn, "solve_batch",
                        lambda *args, **kw: calls.append(1) or solve(*args, **kw))
    loss, ctx = fast.wcontrastive_forward(features, [0, 0, 1, 1], margin=5.0, eps=0.5, p=2)
    assert len(calls) == 2                       # cross pairs and self problems: two batches
    grads = fast.wcontrastive_backward(ctx, 1.0)
    assert len(calls) == 2 and grads.features.dtype == np.float32
    _, ctx = fast.entropic_ot_forward(*_problem(np.random.default_rng(6)), eps=0.5,
                                      value="transport_cost")
    fast.entropic_ot_backward(ctx, 1.0)
    assert len(calls) == 3


@pytest.mark.parametrize("symmetric", [False, True])
def test_kernel_scaling_matches_log_domain(monkeypatch, symmetric):
    # The NumPy kernel-scaling loop (re-absorbing problems whose scalings leave range)
    # and the log-domain loop solve the same problems to the same potentials.
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 8, 2))
    y = x if symmetric else rng.standard_normal((6, 8, 2))
    cost = np.sum((x[:, :, None] - y[:, None]) ** 2, axis=-1)
    cost /= 2 * cost.max()
    a = np.full((6, 8), 1 / 8)
    absorbed = []
    kernel = _ot_sinkhorn._absorbed_kernel
    # A narrow window [e^-0.01, e^0.01] forces re-absorptions.
    monkeypatch.setattr(_ot_sinkhorn, "_ABSORB", {np.dtype(np.float64): 0.01})
    monkeypatch.setattr(_ot_sinkhorn, "_absorbed_kernel",
                        lambda *args, out=None: absorbed.append(out is None) or kernel(*args, out=out))
    results = {}
    for scaling in (True, False):
        monkeypatch.setattr(_ot_sinkhorn, "_USE_SCALING", scaling)
        results[scaling] = _ot_sinkhorn.solve_batch(np, a, a, cost, eps=1e-2, max_iter=5000,
                                                    tol=1e-10, eps_scaling=None,
                                                    symmetric=symmetric)
    assert any(absorbed)                          # some problem was re-absorbed
    assert results[True].converged.all() and results[False].converged.all()
    assert_allclose(results[True].f, results[False].f, rtol=0, atol=1e-8)
    assert_allclose(results[True].plan, results[False].plan, rtol=0, atol=1e-9)


# ------------------------------------------------------- issue 20: the same messages


def _message(call):
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("scale, eps", [(1e-200, 0.1), (1e200, 0.1), (1.0, 1e-300), (1.0, 1e300)])
def test_eps_range_errors_are_the_references(scale, eps):
    """float64: the fast path refuses what the reference refuses, with its words (the data
    named where they, not eps, are far from 1)."""
    rng = np.random.default_rng(8)
    features = scale * rng.standard_normal((4, 3, 2))
    x, y = features[0], features[1]
    cost = scale * np.abs(rng.standard_normal((3, 2)))
    calls = [
        lambda m: m.wcontrastive(features, [0, 0, 1, 1], margin=1.0, eps=eps),
        lambda m: m.wtriplet(features, [0, 0, 1, 1], margin=1.0, eps=eps),
        lambda m: m.pairwise_sinkhorn_divergence(features, eps=eps, p=1),
        lambda m: m.sinkhorn_divergence(x, y, eps=eps, p=1),
        lambda m: m.sinkhorn(np.ones(3), np.ones(2), cost, eps=eps),
    ]
    for call in calls:
        expected = _message(lambda: call(reference))
        assert _message(lambda: call(fast)) == expected
        assert expected.startswith("eps ==") == (scale == 1.0)


def test_float32_eps_range_names_the_features_at_float32_limits():
    features = (1e-20 * np.random.default_rng(9).standard_normal((4, 3, 2))).astype(np.float32)
    message = _message(lambda: fast.wcontrastive(features, [0, 0, 1, 1], margin=1.0, eps=0.1))
    assert message.startswith("features out of range for eps == 0.1")
    assert "times it, above 1000:" in message and "left in float32" in message


def test_batch_mismatch_and_weight_gradients_are_the_references():
    cost = np.ones((2, 4, 5))
    for a, b in [(np.ones((3, 4)), np.ones(5)), (np.ones((2, 4)), np.ones((3, 5)))]:
        assert (_message(lambda: fast.sinkhorn(a, b, cost if a.shape[0] == 3 else cost[0], eps=0.5))
                == _message(lambda: reference.sinkhorn(a, b, cost if a.shape[0] == 3 else cost[0],
                                                       eps=0.5)))
    a, b, c = _problem(np.random.default_rng(10), n=3, m=2)
    for module in (reference, fast):
        _, ctx = module.entropic_ot_forward(1e-310 * a, b, c, eps=0.5)
        with pytest.raises(ValueError, match=r"gradient with respect to a overflows float64"):
            module.entropic_ot_backward(ctx, 1.0)
