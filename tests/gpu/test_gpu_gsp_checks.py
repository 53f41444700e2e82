"""The GSP layer's data checks on its kernels: carried by the kernels, read with what the
layer reads anyway (issue 46), refused with the array path's words.

On the kernels the forward's checks of the points (the inputs' finiteness, a norm beyond the
dtype, a largest norm below its normal range) are one flag per image in the solve summary
(``counts[:, 3]``), and the backward's (the upstream gradients' finiteness, and whether the
result left the dtype, which decides the float32 / float64 retries) one status array: one
host read per call. Where a flag is set the host runs the array path's checks, so the
message is the one they give. Each refusal here is compared with the array path's own, run
on the same input; the CUDA rows run under Numba's simulator, on CuPy arrays where the CuPy
stand-in is installed (``REFDML_CUPY_STANDIN=1``: there the checks are the kernels'; on
NumPy they read nothing and run before the kernels).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

from refdml._backend import to_numpy
from refdml.gpu import gsp as fast
from refdml.gpu import use_kernels
from refdml.gpu.gsp import _mirrors

KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
ARGS = dict(mu=0.3, inverse_temperature=5.0)

standin = pytest.mark.skipif(
    not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
    reason="counts host reads on the CuPy stand-in: REFDML_CUPY_STANDIN=1 "
           "(scripts/ci_cupy_standin.sh)")


def _inputs(dtype=np.float32):
    rng = np.random.default_rng(46)
    features = rng.standard_normal((2, 5, 4)).astype(dtype)
    prototypes = rng.standard_normal((3, 4)).astype(dtype)
    d_pooled = rng.standard_normal((2, 4)).astype(dtype)
    d_z = rng.standard_normal((2, 3)).astype(dtype)
    return features, prototypes, d_pooled, d_z


def _refusal(call):
    """The message of the ValueError ``call()`` raises (the test fails if none)."""
    with warnings.catch_warnings():
        # NaN and inf flow through the simulated kernels' NumPy scalars before the read
        warnings.filterwarnings("ignore", "(overflow|invalid value) encountered", RuntimeWarning)
        with pytest.raises(ValueError) as caught:
            call()
    return str(caught.value)


def _forward(kind, move, features, prototypes, **args):
    with use_kernels(kind):
        return fast.gsp_pool_forward(move(features), move(prototypes), **{**ARGS, **args})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "index", "value"), [
    ("features", (1, 2, 3), np.nan), ("features", (0, 4, 0), -np.inf),
    ("prototypes", (2, 1), np.inf), ("prototypes", (0, 0), np.nan)])
def test_a_non_finite_input_is_refused_as_on_the_array_path(kind, name, index, value,
                                                            cuda_device_array):
    features, prototypes, _, _ = _inputs()
    bad = {"features": features, "prototypes": prototypes}
    bad[name] = bad[name].copy()
    bad[name][index] = value
    move = cuda_device_array if kind == "cuda" else (lambda x: x)
    want = _refusal(lambda: _forward("array", lambda x: x, bad["features"], bad["prototypes"]))
    assert want.startswith(f"{name} must be finite") and str(index) in want, want
    assert _refusal(lambda: _forward(kind, move, bad["features"], bad["prototypes"])) == want


@pytest.mark.parametrize("kind", KINDS)
def test_the_datas_error_still_comes_before_a_bad_argument(kind, cuda_device_array):
    # The finiteness checks ran before the scalar arguments' and still do: the kernels take
    # them over only once the arguments are valid.
    features, prototypes, _, _ = _inputs()
    features[0, 1, 2] = np.nan
    move = cuda_device_array if kind == "cuda" else (lambda x: x)
    want = _refusal(lambda: _forward("array", lambda x: x, features, prototypes, mu=1.5))
    assert want.startswith("features must be finite"), want
    assert _refusal(lambda: _forward(kind, move, features, prototypes, mu=1.5)) == want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "index", "value"), [
    ("d_pooled", (1, 3), np.inf), ("d_pooled", (0, 0), np.nan),
    ("d_z", (1, 2), np.nan), ("d_z", (0, 1), -np.inf)])
def test_a_non_finite_upstream_is_refused_as_on_the_array_path(kind, name, index, value,
                                                               cuda_device_array):
    features, prototypes, d_pooled, d_z = _inputs()
    upstream = {"d_pooled": d_pooled, "d_z": d_z}
    upstream[name] = upstream[name].copy()
    upstream[name][index] = value
    move = cuda_device_array if kind == "cuda" else (lambda x: x)

    def backward(mode, to):
        _, ctx = _forward(mode, to, features, prototypes)
        with use_kernels(mode):
            fast.gsp_pool_backward(ctx, to(upstream["d_pooled"]), to(upstream["d_z"]))

    want = _refusal(lambda: backward("array", lambda x: x))
    assert want.startswith(f"{name} must be finite") and str(index) in want, want
    assert _refusal(lambda: backward(kind, move)) == want


@pytest.mark.parametrize("kind", KINDS)
def test_an_upstream_beyond_float32_is_named_as_on_the_array_path(kind, cuda_device_array):
    # float64 upstreams of a float32 layer are cast; one beyond float32 is named (the cast's
    # check), not reported as inf
    features, prototypes, d_pooled, d_z = _inputs()
    d_pooled = d_pooled.astype(np.float64)
    d_pooled[1, 0] = 1e39
    move = cuda_device_array if kind == "cuda" else (lambda x: x)

    def backward(mode, to):
        _, ctx = _forward(mode, to, features, prototypes)
        with use_kernels(mode):
            fast.gsp_pool_backward(ctx, to(d_pooled), to(d_z))

    want = _refusal(lambda: backward("array", lambda x: x))
    assert want.startswith("d_pooled[(1, 0)] == 1e+39 is beyond the float32 range"), want
    assert _refusal(lambda: backward(kind, move)) == want


@pytest.mark.parametrize("kind", KINDS)
def test_the_float64_retry_is_taken_where_the_float32_backward_overflows(
        kind, cuda_device_array, monkeypatch):
    # Features of norm 1e38 and an upstream of ~3: the float32 backward's intermediates
    # overflow (the kernels' status says so) where the gradients, ~7e37, do not; it is redone
    # in float64 on the widened context, as on the array path. An upstream of ~0.1 is not
    # redone. The gradients equal the array path's either way.
    rng = np.random.default_rng(31)
    features = np.abs(rng.standard_normal((2, 6, 3)))
    features *= 1e38 / np.linalg.norm(features, axis=-1, keepdims=True)
    prototypes = rng.standard_normal((4, 3))
    d_pooled, d_z = rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    widened = []
    real_widened = _mirrors._widened
    monkeypatch.setattr(_mirrors, "_widened", lambda ctx: widened.append(1) or real_widened(ctx))
    move = cuda_device_array if kind == "cuda" else (lambda x: x)
    for factor, retried in ((3.0, True), (0.1, False)):
        grads = {}
        for mode, to in (("array", lambda x: x), (kind, move)):
            del widened[:]
            with use_kernels(mode), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "(overflow|invalid value) encountered",
                                        RuntimeWarning)
                _, ctx = fast.gsp_pool_forward(to(features.astype(np.float32)),
                                               to(prototypes.astype(np.float32)), mu=0.1,
                                               inverse_temperature=5.0)
                grads[mode] = fast.gsp_pool_backward(
                    ctx, to((factor * d_pooled).astype(np.float32)), to(d_z.astype(np.float32)))
            assert bool(widened) == retried, (mode, factor)
        for name in ("features", "prototypes"):
            got = to_numpy(getattr(grads[kind], name)).astype(np.float64)
            want = to_numpy(getattr(grads["array"], name)).astype(np.float64)
            assert np.all(np.isfinite(got)), name
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_column_rank_is_a_permutation_with_nan_last():
    # A non-finite input reaches the kernels before the host reads their checks; the stable
    # order of the column minima must still be a permutation (the search indexes by it), and
    # the CPU twin's (argsort, NaN last) order.
    from refdml.gpu.gsp._compiled import column_rank

    rng = np.random.default_rng(4)
    for _ in range(20):
        values = rng.integers(0, 4, (1, 9)).astype(np.float64)
        values[0, rng.random(9) < 0.4] = np.nan
        values[0, rng.random(9) < 0.1] = np.inf
        ranks = [column_rank(values, 0, j) for j in range(9)]
        order = np.empty(9, dtype=np.int64)
        order[ranks] = np.arange(9)
        assert sorted(ranks) == list(range(9)), ranks
        np.testing.assert_array_equal(order, np.argsort(values[0], kind="mergesort"))


# ------------------------------------------------------------------ reads on the stand-in
def _catalogue_inputs():
    import cupy

    from refdml.catalog import get

    spec = get("gsp.pool")
    rng = np.random.default_rng(0)
    inputs = {k: (cupy.asarray(v.astype(np.float32)) if isinstance(v, np.ndarray) else v)
              for k, v in spec.make_inputs(rng).items()}
    return spec, inputs, rng


@standin
@pytest.mark.requires_cuda
def test_one_read_for_the_pair_inside_a_deferring_scope_and_its_failure_at_that_read():
    # Inside refdml._deferred.deferring(reads, operator_checks=True) the forward records its
    # summary and checks; the backward's read (the retry decision needs it now) takes them
    # along: one transfer for the pair. A NaN feature is then refused at that read, with the
    # forward's message, and the backward returns nothing.
    import cupy
    from cupy_standin import count_transfers

    from refdml._deferred import DeferredReads, deferring

    spec, inputs, rng = _catalogue_inputs()
    forward, backward = spec.mirror_pair()
    with use_kernels("cuda"):
        (pooled, z), _ = forward(**inputs)
        upstream = [cupy.asarray(rng.standard_normal(o.shape).astype(np.float32))
                    for o in (pooled, z)]
        reads = DeferredReads()
        with count_transfers() as transfers, deferring(reads, operator_checks=True):
            _, ctx = forward(**inputs)
            assert transfers.total == 0 and len(reads) == 1, transfers
            grads = backward(ctx, *upstream)
        assert (transfers.total, reads.reads, len(reads)) == (1, 1, 0), transfers
        assert not isinstance(ctx.transport.n_iter, int)   # the device column: read in the scope
        assert np.all(np.isfinite(to_numpy(grads.features)))

        features = to_numpy(inputs["features"]).copy()
        features[1, 0, 1] = np.nan
        bad = {**inputs, "features": cupy.asarray(features)}
        with use_kernels("array"):
            want = _refusal(lambda: forward(**{**bad, "features": features,
                                              "prototypes": to_numpy(inputs["prototypes"])}))
        reads = DeferredReads()

        def pair():
            with deferring(reads, operator_checks=True):
                _, bad_ctx = forward(**bad)
                backward(bad_ctx, *upstream)

        with count_transfers() as transfers:
            got = _refusal(pair)
        assert got == want, (got, want)
        assert reads.reads == 1
