"""The fast path of normalize and distances beyond the parity suite: bad input named,
float32 at extreme scales, backward without recomputation, no CuPy needed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import distances as ref_distances
from refdml import normalize as ref_normalize
from refdml.gpu import distances, normalize


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="x must be finite"):
        normalize.l2_normalize_forward(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="x has a zero vector at row 1"):
        normalize.l2_normalize_forward(np.array([[1.0, 2.0], [0.0, 0.0]], dtype=np.float32))
    with pytest.raises(TypeError, match="x must be an array of real numbers"):
        normalize.clip_normalize_forward(np.array([True, False]))
    with pytest.raises(ValueError, match="x and y must have the same last dimension"):
        distances.euclidean_forward(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="y has a zero vector at row 0"):
        distances.cosine_forward(np.ones((2, 3)), np.zeros((1, 3)))
    _, ctx = distances.euclidean_forward(np.eye(3), np.ones((2, 3)))
    with pytest.raises(TypeError, match="ctx must be the EuclideanContext"):
        distances.euclidean_backward(object(), np.ones((3, 2)))
    with pytest.raises(ValueError, match="d_distance has shape"):
        distances.euclidean_backward(ctx, np.ones((2, 3)))
    with pytest.raises(ValueError, match="d_distance must be finite"):
        distances.euclidean_backward(ctx, np.full((3, 2), np.inf))


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e20, 1e30])
def test_float32_at_extreme_scales(scale):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4))
    y = rng.standard_normal((3, 4))
    x32, y32 = (scale * x).astype(np.float32), (scale * y).astype(np.float32)
    out, ctx = normalize.l2_normalize_forward(x32)
    assert out.dtype == np.float32
    assert_allclose(out, ref_normalize.l2_normalize(x32.astype(np.float64)), rtol=0, atol=1e-6)
    d_x = normalize.l2_normalize_backward(ctx, np.ones_like(x32)).x
    expected = ref_normalize.l2_normalize_backward(
        ref_normalize.l2_normalize_forward(x32.astype(np.float64))[1], np.ones(x.shape)).x
    assert np.all(np.isfinite(d_x))
    assert_allclose(d_x, expected, rtol=1e-5, atol=1e-5 * np.max(np.abs(expected)))
    s = distances.cosine(x32, y32)
    assert_allclose(s, ref_distances.cosine(x, y), atol=1e-6)
    d = distances.euclidean(x32, y32)
    assert np.all(np.isfinite(d)) and d.dtype == np.float32
    assert_allclose(d / scale, ref_distances.euclidean(x, y), rtol=1e-5)


def test_sq_euclidean_overflow_is_named_in_float32():
    with pytest.raises(ValueError, match="squared distances overflow float32"):
        distances.sq_euclidean_forward(np.full((2, 3), 1e30, np.float32),
                                       np.full((1, 3), -1e30, np.float32))


def test_backward_does_not_recompute(monkeypatch):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((5, 3))
    _, ctx = distances.euclidean_forward(x, y)

    def boom(*args, **kwargs):
        raise AssertionError("the backward recomputed the distances")

    monkeypatch.setattr(distances, "scaled_sq", boom)
    # The fast path's normalisation is the reference's xp-generic kernel.
    monkeypatch.setattr(ref_normalize, "_scaled_direction", boom)
    distances.euclidean_backward(ctx, np.ones((4, 5)))


def test_import_without_cupy(tmp_path):
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import numpy as np\n"
        "from refdml.gpu import normalize, distances, losses, histogram, prototypes, crossbatch\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(distances.cosine(np.eye(2), np.eye(2)).sum())\n"
    )
    # cwd outside the checkout: the process imports refdml as installed.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


def test_gradients_of_subnormal_rows_give_the_references_message():
    x = np.random.default_rng(7).standard_normal((4, 3))
    x[2] *= 1e-310
    messages = []
    for module in (ref_normalize, normalize):
        _, ctx = module.l2_normalize_forward(x)
        with pytest.raises(ValueError) as info:
            module.l2_normalize_backward(ctx, np.ones((4, 3)))
        messages.append(str(info.value))
    for module in (ref_distances, distances):
        _, ctx = module.cosine_forward(x, np.ones((2, 3)))
        with pytest.raises(ValueError) as info:
            module.cosine_backward(ctx, np.ones((4, 2)))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[2] == messages[3]
    assert messages[0].startswith("the gradient with respect to x overflows float64 at row 2")
    assert messages[2].startswith("the gradient with respect to x overflows float64 at row 2")


@pytest.mark.parametrize("dtype, offset", [(np.float64, 1e-9), (np.float32, 1e-5)])
def test_coincident_and_nearby_pairs_are_the_references_on_numpy(monkeypatch, dtype, offset):
    # The Gram identity's absolute error ~ u (|x|^2 + |y|^2) leaves a pair closer than
    # ~sqrt(u) |x| without a digit (coincident rows could get ~sqrt(u) |x|, not 0; the
    # gradient (x_i - y_j) / D_ij was O(1) off). On NumPy those pairs are recomputed from
    # explicit differences, as the reference does. Offsets: well below sqrt(u) relative,
    # representable. The backward (the reference's formula, w.sum() x - w @ y) cancels
    # at a nearby pair to ~u / offset relative (float32 here against the float64
    # reference: measured 0.17 of that; 0.18 norm-wise without the refinement, either dtype).
    from refdml._backend import get_backend
    from refdml.gpu.losses._pairwise import self_euclidean

    rng = np.random.default_rng(80)
    x = (10.0 + 3.0 * rng.standard_normal((6, 4))).astype(dtype)
    y = np.concatenate([x[:2], x[2:4] * (1 + offset * rng.choice([-1, 1], (2, 4))),
                        rng.standard_normal((2, 4))]).astype(dtype)
    want, want_ctx = ref_distances.euclidean_forward(x.astype(np.float64), y.astype(np.float64))
    upstream = rng.standard_normal(want.shape)
    want_grads = ref_distances.euclidean_backward(want_ctx, upstream)
    u = float(np.finfo(dtype).eps)

    def errors():
        got, ctx = distances.euclidean_forward(x, y)
        grads = distances.euclidean_backward(ctx, upstream.astype(dtype))
        nearby = np.max(np.abs(got - want)[[2, 3], [2, 3]] / want[[2, 3], [2, 3]])
        gradient = max(np.max(np.abs(g - w)) / np.max(np.abs(w))
                       for g, w in ((grads.x, want_grads.x), (grads.y, want_grads.y)))
        return got, nearby, gradient

    got, nearby, gradient = errors()
    # Identical rows: the refined value is a sum of squares of exact zero differences.
    assert np.all(got[[0, 1], [0, 1]] == 0)
    assert_allclose(got, want, rtol=64 * u)
    assert nearby <= 64 * u and gradient <= u / offset, (nearby, gradient)
    # The losses' distances of a set with itself: duplicate rows exactly 0 there too.
    duplicated = np.concatenate([x, x[:2]])
    distance, _, _ = self_euclidean(get_backend(duplicated), duplicated)
    assert np.all(distance[[0, 1], [6, 7]] == 0) and np.all(distance[[6, 7], [0, 1]] == 0)
    # Without the refinement the nearby pairs and the gradient fail (the check can fail).
    monkeypatch.setattr(distances, "_REFINE", -1.0)
    _, nearby, gradient = errors()
    assert nearby > 0.1 and gradient > u / offset, (nearby, gradient)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [3, 64])
def test_unrefined_near_pairs_are_within_the_stated_tolerance(monkeypatch, dtype, d):
    # What the CuPy backend computes: it skips the near-pair refinement (Backend.refine), so a
    # near pair keeps the Gram identity's value, within refdml.gpu.distances' stated bound
    # |D~^2 - D^2| <= (2 d + 4) u (|x_i|^2 + |y_j|^2), and D~ within its square root. Run on
    # NumPy with the refinement skipped as the CuPy backend skips it; the expected values are
    # explicit float64 differences of the same (rounded) inputs.
    from refdml._backend import Backend

    monkeypatch.setattr(Backend, "refine", lambda self, step, *args: None)
    rng = np.random.default_rng(81)
    centre = 10.0 * rng.standard_normal(d)
    x = (centre + rng.standard_normal((24, d))).astype(dtype)
    y = np.concatenate([x[:12], x[12:18] * (1 + 1e-6 * rng.standard_normal((6, d))),
                        centre + rng.standard_normal((4, d))]).astype(dtype)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    exact_sq = np.sum((x64[:, None, :] - y64[None, :, :]) ** 2, axis=-1)
    bound_sq = (2 * d + 4) * float(np.finfo(dtype).eps) * (
        np.sum(x64 ** 2, axis=1)[:, None] + np.sum(y64 ** 2, axis=1)[None, :])
    sq = distances.sq_euclidean(x, y).astype(np.float64)
    distance = distances.euclidean(x, y).astype(np.float64)
    assert np.all(np.abs(sq - exact_sq) <= bound_sq)
    # sqrt of the rounded square: one more rounding of the result, u D relative.
    slack = 2 * float(np.finfo(dtype).eps) * np.sqrt(exact_sq)
    assert np.all(np.abs(distance - np.sqrt(exact_sq)) <= np.sqrt(bound_sq) + slack)
    # The route is the unrefined one (coincident rows not all exactly 0; refined they are).
    coincident = np.arange(12)
    assert np.any(distance[coincident, coincident] > 0)


@pytest.mark.parametrize("mode", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_l2_members_keep_zero_rows_and_the_power_of_two_scale(mode, dtype,
                                                                       cuda_device_array):
    # The family's compiled members (no data check: they see zero rows) against the array
    # path, member to member: a zero row is y = 0, s = 1/2, ||x / s|| = 0 exactly (the
    # reference's frexp(0) = (0, 0)); the other rows' s is a power of two with max|x| / s in
    # [1, 2), at scales whose squares overflow or underflow the dtype. The CUDA member takes
    # the input where its kernels run (a CuPy array on a GPU: a NumPy one there is refused,
    # as the H200 run of 2026-11-30 found this test doing).
    from refdml._backend import get_backend, to_numpy
    from refdml.gpu import use_kernels

    big, tiny = (1e30, 1e-30) if dtype == np.float32 else (1e300, 1e-300)
    x = np.array([[0.0, 0.0, 0.0], [3.0, -4.0, 0.0], [big, -big, big / 2],
                  [tiny, 0.0, -tiny / 4]], dtype=dtype)
    array = normalize.IMPLEMENTATIONS.array.l2_forward(get_backend(x), x)
    moved = cuda_device_array(x) if mode == "cuda" else x
    with use_kernels(mode):
        y, scale, scaled_norm = (to_numpy(a) for a in normalize.IMPLEMENTATIONS.choose(
            moved).l2_forward(get_backend(moved), moved))
    assert y.dtype == scale.dtype == scaled_norm.dtype == dtype
    assert scale.shape == scaled_norm.shape == (4, 1)
    assert np.all(y[0] == 0) and scale[0, 0] == 0.5 and scaled_norm[0, 0] == 0
    peak = np.max(np.abs(x[1:]), axis=1, keepdims=True)
    assert np.all((peak / scale[1:] >= 1) & (peak / scale[1:] < 2))
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))
    assert np.array_equal(scale, array[1])
    assert_allclose(scaled_norm, array[2], rtol=4 * np.finfo(dtype).eps)
    assert_allclose(y, array[0], rtol=4 * np.finfo(dtype).eps, atol=0)
    assert_allclose(y[1], [0.6, -0.8, 0.0], rtol=4 * np.finfo(dtype).eps)
