"""refdml.gpu.ot beyond the parity suite: errors named, float32 at small eps, convergence
reported and warned, no re-solve in the backward."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import ot as reference
from refdml.exceptions import ConvergenceWarning
from refdml.gpu.ot import _sinkhorn as _ot_sinkhorn
from refdml.gpu.ot import IMPLEMENTATIONS
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
                                                    symmetric=symmetric,
                                                    impl=IMPLEMENTATIONS.choose(cost))
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


# ------------------------------------------------------- issue 20: extreme magnitudes


def _quiet_call(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # RuntimeWarnings and ConvergenceWarnings alike
        return call()


def _clouds(rng, batch=4, n=3, dim=2):
    return rng.uniform(-1.0, 1.0, (batch, n, dim))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tol_beyond_float32_is_every_iterate(dtype):
    # tol = 1e300 on float32: err <= tol cast tol to float32 (inf, a RuntimeWarning). Any
    # finite marginal error is below it: converged at the first check, as the reference.
    # eps = 0.2 lies below every problem's largest cost here, where the reference returns
    # that first iterate too (above it, it adds exact log-domain half steps: _finish_large_eps).
    rng = np.random.default_rng(60)
    a, b, cost = _problem(rng)
    clouds = _clouds(rng)
    calls = [
        lambda m, c: m.sinkhorn(a.astype(c), b.astype(c), cost.astype(c), eps=0.2, tol=1e300).f,
        lambda m, c: m.sinkhorn_divergence(clouds[0].astype(c), clouds[1].astype(c), eps=0.2,
                                           tol=1e300)[0],
        lambda m, c: m.pairwise_sinkhorn_divergence(clouds.astype(c), eps=0.2, tol=1e300),
        lambda m, c: m.wcontrastive(clouds.astype(c), [0, 0, 1, 1], margin=1.0, eps=0.2,
                                    tol=1e300)[0],
    ]
    for call in calls:
        expected = call(reference, np.float64)
        got = _quiet_call(lambda: call(fast, dtype))
        assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=1e-5)
    result = _quiet_call(lambda: fast.sinkhorn(a.astype(dtype), b.astype(dtype),
                                               cost.astype(dtype), eps=0.2, tol=1e300))
    assert result.converged and result.n_iter == 0


@pytest.mark.parametrize("loss", ["wcontrastive", "wtriplet"])
@pytest.mark.parametrize("margin", [1e38, 3e38, 1e300])
def test_float32_margins_beyond_its_range_are_the_references(loss, margin):
    # margin - d_w with a margin of 1e300 cast it to float32 (inf); K terms near 1e38
    # summed in float32 overflowed. The terms are float64 where the margin is no float32
    # and the loss is summed in float64: the reference's value, the same O(1) gradient.
    rng = np.random.default_rng(61)
    features = _clouds(rng)
    expected, ref_grads = getattr(reference, loss)(features, [0, 0, 1, 1], margin=margin,
                                                   eps=0.5)
    got, grads = _quiet_call(lambda: getattr(fast, loss)(features.astype(np.float32),
                                                         [0, 0, 1, 1], margin=margin, eps=0.5))
    assert_allclose(got, expected, rtol=1e-6)
    assert grads.features.dtype == np.float32
    assert_allclose(grads.features, ref_grads.features, rtol=0,
                    atol=2e-5 * np.abs(ref_grads.features).max())


@pytest.mark.parametrize("scale", [1e-40, 1e-44])
def test_float32_subnormal_inputs_are_the_references(scale):
    # cost * (1 / unit) and clouds * (1 / scale) cast 2^133 .. 2^147 to float32 (inf, a
    # RuntimeWarning). Divided by the power of two (ldexp, exact) instead. The reference
    # computes on the same (rounded, subnormal) float32 values.
    rng = np.random.default_rng(62)
    a, b, cost = _problem(rng)
    clouds = _clouds(rng)
    with np.errstate(under="ignore"):
        cost32, clouds32 = (scale * cost).astype(np.float32), (scale * clouds).astype(np.float32)
    cost64, clouds64 = cost32.astype(np.float64), clouds32.astype(np.float64)
    eps = 0.5 * float(np.max(cost64))
    got = _quiet_call(lambda: fast.sinkhorn(a.astype(np.float32), b.astype(np.float32), cost32,
                                            eps=eps, tol=1e-6))
    want = reference.sinkhorn(a, b, cost64, eps=eps, tol=1e-9)
    assert_allclose(got.plan, want.plan, rtol=0, atol=1e-5 * want.plan.max())
    largest = float(np.max(np.linalg.norm(clouds64[0][:, None] - clouds64[1][None], axis=-1)))
    args = dict(eps=0.5 * largest, p=1)
    got_sd, got_grads = _quiet_call(lambda: fast.sinkhorn_divergence(clouds32[0], clouds32[1],
                                                                      tol=1e-6, **args))
    want_sd, want_grads = reference.sinkhorn_divergence(clouds64[0], clouds64[1], **args)
    # The divergence ~ scale is itself near float32's least subnormal (2^-149 ~ 1.4e-45)
    # at 1e-44: one rounding there.
    subnormal = 2.0**-149
    assert_allclose(got_sd, want_sd, rtol=1e-4, atol=subnormal)
    assert_allclose(got_grads.x, want_grads.x, rtol=0, atol=1e-4 * np.abs(want_grads.x).max())
    got_loss, got_grads = _quiet_call(lambda: fast.wcontrastive(
        clouds32, [0, 0, 1, 1], margin=scale, eps=0.5 * largest, tol=1e-6))
    want_loss, want_grads = reference.wcontrastive(clouds64, [0, 0, 1, 1], margin=scale,
                                                   eps=0.5 * largest)
    assert_allclose(got_loss, want_loss, rtol=1e-4, atol=subnormal)
    assert_allclose(got_grads.features, want_grads.features, rtol=0,
                    atol=1e-4 * np.abs(want_grads.features).max())


@pytest.mark.parametrize("dtype, p", [(np.float64, 1e5), (np.float64, 1e300),
                                      (np.float32, 1e5), (np.float32, 1e30)])
def test_huge_p_is_the_references(dtype, p):
    # Largest distance exactly 1: (D / D_max)^p is 1 there and 0 elsewhere at these p;
    # once 2^p overflowed (a RuntimeWarning in both dtypes, 1e38 and beyond).
    x = np.array([[0.0, 0.0], [0.5, 0.0], [0.2, 0.3]])
    y = np.array([[1.0, 0.0], [0.7, 0.1]])
    clouds = np.stack([x, np.concatenate([y, [[0.6, 0.2]]])])
    want_sd, want_grads = reference.sinkhorn_divergence(x, y, eps=0.1, p=p)
    got_sd, got_grads = _quiet_call(lambda: fast.sinkhorn_divergence(
        x.astype(dtype), y.astype(dtype), eps=0.1, p=p))
    rtol = 1e-5 if dtype == np.float32 else 1e-10
    assert_allclose(got_sd, want_sd, rtol=rtol)
    for name in ("x", "y"):
        want = getattr(want_grads, name)
        assert_allclose(getattr(got_grads, name), want, rtol=0, atol=rtol * np.abs(want).max())
    want = reference.pairwise_sinkhorn_divergence(clouds, eps=0.1, p=p)
    got = _quiet_call(lambda: fast.pairwise_sinkhorn_divergence(clouds.astype(dtype), eps=0.1,
                                                                p=p))
    assert_allclose(got, want, rtol=rtol)


def test_p_beyond_float32_is_computed_forward_and_named_backward():
    # p = 1e300 on float32: the costs are the limit (computed, as the reference); the
    # gradient is p times the cost at the largest distance, which no float32 holds.
    x = np.array([[0.0, 0.0], [0.5, 0.0]], np.float32)
    y = np.array([[1.0, 0.0], [0.7, 0.1]], np.float32)
    want, _ = reference.sinkhorn_divergence_forward(x.astype(np.float64), y.astype(np.float64),
                                                    eps=0.1, p=1e300)
    got, ctx = _quiet_call(lambda: fast.sinkhorn_divergence_forward(x, y, eps=0.1, p=1e300))
    assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^p == 1e\+300 is beyond float32's range: the "
                                         r"gradient p \|\|x - y\|\|\^\(p-1\) cannot be formed"):
        fast.sinkhorn_divergence_backward(ctx, 1.0)
    # p = 1e38 is a float32: the gradient (~3e35 here) is computed as the reference's;
    # 1e4 times it is beyond float32, named.
    _, ref_ctx = reference.sinkhorn_divergence_forward(x.astype(np.float64),
                                                       y.astype(np.float64), eps=0.1, p=1e38)
    want = reference.sinkhorn_divergence_backward(ref_ctx, 1.0)
    _, ctx = _quiet_call(lambda: fast.sinkhorn_divergence_forward(x, y, eps=0.1, p=1e38))
    got = _quiet_call(lambda: fast.sinkhorn_divergence_backward(ctx, 1.0))
    # The only nonzero entry is p times one plan entry (~3e-3 of the mass): float32
    # Sinkhorn gives it to ~1e-4 relative (measured 1e-4; the catalogue's 1e-4 is
    # relative to the largest gradient of better-spread problems).
    assert_allclose(got.x, want.x, rtol=0, atol=1e-3 * np.abs(want.x).max())
    with pytest.raises(ValueError, match=r"^the gradient with respect to x overflows float32 "
                                         r"\(p == 1e\+38"):
        fast.sinkhorn_divergence_backward(ctx, 1e4)


def test_p_out_of_the_data_range_is_the_references_error():
    rng = np.random.default_rng(63)
    features = 3 * _clouds(rng)
    for p in (1000.0, 1e38, 1e300):
        expected = _message(lambda: reference.wcontrastive(features, [0, 0, 1, 1], margin=1.0,
                                                           eps=0.1, p=p))
        assert expected.startswith(f"p == {p:g}: the largest cost")
        for dtype in (np.float32, np.float64):
            assert _message(lambda: fast.wcontrastive(features.astype(dtype), [0, 0, 1, 1],
                                                      margin=1.0, eps=0.1, p=p)) == expected


@pytest.mark.parametrize("value", ["regularized", "transport_cost"])
def test_weight_gradient_where_points_coincide_is_the_references(value):
    # y scaled by 1e-300 next to x of order 1: the divergence does not depend on b, whose
    # gradient is 0. Both return (g - <g, b>) / |b| (the gradient of SD(b / |b|), unique;
    # the potentials' constant never reaches it) formed against the largest weight; once
    # reference and fast path returned different ulps of |g| along (1, ..., 1). Compared to
    # the rounding of the potentials, and modulo that constant to the rounding of the values.
    rng = np.random.default_rng(64)
    x, y = 3 * rng.standard_normal((5, 3)), 1e-300 * rng.standard_normal((4, 3)) + 1.0
    a, b = rng.uniform(0.5, 1.0, 5), rng.uniform(0.5, 1.0, 4)
    args = dict(eps=0.1, value=value, tol=1e-12, max_iter=20000)
    want, ctx = reference.sinkhorn_divergence_forward(x, y, a, b, **args)
    want_grads = reference.sinkhorn_divergence_backward(ctx, 1.0)
    got, got_grads = _quiet_call(lambda: fast.sinkhorn_divergence(x, y, a, b, **args))
    scale = ctx.unit * np.abs(ctx.xy.g).max() / ctx.b_mass
    rounding = 64 * np.finfo(float).eps * scale * 4
    for grad_b in (want_grads.b, got_grads.b):
        assert_allclose(grad_b, 0.0, atol=rounding)
    difference = got_grads.b - want_grads.b
    assert_allclose(difference - difference.mean(), 0.0, atol=rounding)
    assert_allclose(got_grads.a, want_grads.a, rtol=0, atol=1e-9 * np.abs(want_grads.a).max())


def _mixed_scale_problems(rng, scales=(1.0, 1e-4, 1e-10), n=5, m=4):
    """A batch whose problems' largest costs are ``scales`` times that of the first: at
    eps = 1e-2 of the largest cost the first is solved as usual, the others have eps
    1e2 and 1e8 times their largest cost (the large-eps finish applies to them only)."""
    x, y = rng.standard_normal((len(scales), n, 2)), rng.standard_normal((len(scales), m, 2))
    cost = np.sum((x[:, :, None] - y[:, None]) ** 2, axis=-1)
    cost *= (np.asarray(scales) / cost.max(axis=(1, 2)))[:, None, None]
    a, b = rng.uniform(0.5, 1.0, (len(scales), n)), rng.uniform(0.5, 1.0, (len(scales), m))
    return a, b, cost, 1e-2


def test_large_eps_finish_is_the_references(monkeypatch):
    # The reference ends a solve whose eps exceeds the problem's largest cost with three
    # exact log-domain half steps and sums the value's mass term through expm1
    # (refdml/ot/_sinkhorn.py, docs/ot.md Sec. 2); without them the fast path's weight
    # gradients were ~1e-7 (here) to 7e-5 (ot.sinkhorn_divergence's "large eps" case) off,
    # with them ~4e-15.
    a, b, cost, eps = _mixed_scale_problems(np.random.default_rng(70))
    args = dict(eps=eps, tol=1e-12, max_iter=20000)
    upstream = np.random.default_rng(71).standard_normal(cost.shape[0])

    def run(module):
        value, ctx = module.entropic_ot_forward(a, b, cost, **args)
        grads = module.entropic_ot_backward(ctx, upstream)
        return value, grads.a, grads.b, grads.cost

    def errors(got, want):
        # Per problem, relative to the problem's largest entry: the problems' scales differ
        # by 1e8.
        return [float(np.max(np.abs(g[p] - w[p])) / np.max(np.abs(w[p])))
                for g, w in zip(got, want) for p in range(cost.shape[0])]

    want = run(reference)
    assert max(errors(run(fast), want)) < 1e-10
    # The same comparison fails without the finish (the check can fail).
    monkeypatch.setattr(_ot_sinkhorn, "_finish_large_eps", lambda xp, batch, smallest: batch)
    assert max(errors(run(fast), want)) > 1e-10


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_large_eps_finish_gathered_or_selected(monkeypatch, dtype):
    # NumPy gathers the problems whose eps exceeds their largest cost; CuPy computes every
    # problem's half steps and keeps them there (where), so as not to read a mask back.
    # Both are held to the reference's finish on the same unfinished batch.
    from refdml.ot import _sinkhorn as ref_sinkhorn

    a, b, cost, eps = _mixed_scale_problems(np.random.default_rng(72))
    a, b = a / a.sum(axis=1, keepdims=True), b / b.sum(axis=1, keepdims=True)
    cost = cost / (1.25 * cost.max())            # the solver's units: largest in [0.5, 1)
    finish = _ot_sinkhorn._finish_large_eps
    monkeypatch.setattr(_ot_sinkhorn, "_finish_large_eps", lambda xp, batch, smallest: batch)
    raw = _quiet_call(lambda: _ot_sinkhorn.solve_batch(
        np, a.astype(dtype), b.astype(dtype), cost.astype(dtype), eps=eps * 0.8,
        max_iter=20000, tol=1e-12, eps_scaling=None, impl=IMPLEMENTATIONS.choose(cost)))
    far = raw.eps > np.abs(raw.cost).max(axis=(1, 2))
    assert far.tolist() == [False, True, True]
    gathered = finish(np, raw, None, gather=True)
    selected = finish(np, raw, None, gather=False)
    f, g, plan = ref_sinkhorn._finish_large_eps(
        np.log(raw.a.astype(np.float64)), raw.a.astype(np.float64), raw.b.astype(np.float64),
        raw.cost.astype(np.float64), raw.eps, raw.f.astype(np.float64),
        raw.g.astype(np.float64), raw.plan.astype(np.float64))
    rtol = 1e-13 if dtype == np.float64 else 1e-5
    for batch in (gathered, selected):
        assert batch.f.dtype == dtype and batch.plan.dtype == dtype
        for got, want in ((batch.f, f), (batch.g, g), (batch.plan, plan)):
            assert_allclose(got[far], want[far], rtol=rtol, atol=rtol * np.abs(want[far]).max())
        # The problem that needs no finish is returned as it was: copied (gather) or
        # selected by where from the unchanged arrays, so bit for bit.
        for got, before in ((batch.f, raw.f), (batch.g, raw.g), (batch.plan, raw.plan)):
            assert np.array_equal(got[~far], before[~far])
    # A caller that knows no problem needs it (eps <= smallest) gets the batch back.
    assert finish(np, raw, 1.0) is raw


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "uniform"])
def test_a_float32_transport_cost_gradient_out_of_range_is_named_not_called_an_overflow(weights):
    # The catalogue's small-eps case (eps = max C / 100): the implicit system of the
    # transport cost has eigenvalues ~1e-41, float32 subnormals without a finite inverse.
    # The ValueError says so (not "overflows ... rescale a" / "use a smaller p"), and no
    # RuntimeWarning escapes first.
    from refdml.catalog import get

    spec = get("ot.sinkhorn_divergence_transport_cost")
    case = {c.name: c for c in spec.reference_inputs(np.random.default_rng(0))}[
        "small eps (1/100 of the largest cost)"]
    inputs = {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype.kind == "f"
              else v for k, v in case.inputs.items() if weights or k not in ("a", "b")}
    _, ctx = fast.sinkhorn_divergence_forward(**inputs)
    with pytest.raises(ValueError, match="gradients of value='transport_cost' are not finite "
                                         "in float32 at these inputs"):
        fast.sinkhorn_divergence_backward(ctx, np.float32(1.0))
