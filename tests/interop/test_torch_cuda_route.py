"""refdml.torch's CUDA route without a GPU: on the CuPy stand-in (REFDML_CUPY_STANDIN=1,
tests/cupy_standin) a tensor stood in for a CUDA one crosses to CuPy and back by DLPack,
refdml runs its CuPy path, and the stand-in counts what crossed: the same memory on both
sides, and no transfer or host synchronisation beyond those of refdml's CuPy path itself
(counted by calling it directly on CuPy arrays: the bridge adds none).

Skipped unless the stand-in is ``cupy`` (CI's PyTorch leg runs this file so).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from numpy.testing import assert_allclose

torch = pytest.importorskip("torch")
cupy_standin = pytest.importorskip("cupy_standin")
if not cupy_standin.installed():
    pytest.skip("needs the CuPy stand-in as cupy (REFDML_CUPY_STANDIN=1)", allow_module_level=True)

import refdml.torch as rt  # noqa: E402
from refdml.gpu import set_finite_checks  # noqa: E402
from refdml.gsp import gsp_pool_backward, gsp_pool_forward  # noqa: E402
from refdml.torch import _convert, _ops  # noqa: E402


@pytest.fixture
def cuda_route(monkeypatch):
    """Tensors take the CUDA branch (CuPy by DLPack); the stream switch, which needs a real
    torch.cuda, is left out."""
    monkeypatch.setattr(_convert, "device_type", lambda tensor: "cuda")
    monkeypatch.setattr(_ops, "on_device", lambda device: contextlib.nullcontext())


@pytest.fixture
def no_data_checks():
    set_finite_checks(False)
    yield
    set_finite_checks(True)


def _fast_path_transfers(name, arrays: dict, options: dict, upstream) -> dict:
    """The transfers of the row's own forward and backward on stand-in arrays."""
    import cupy

    from refdml._interop import bridged, flat_outputs

    row = bridged(name)
    device = {k: cupy.asarray(v) for k, v in arrays.items()}
    upstream = [cupy.asarray(u) for u in upstream]
    with cupy_standin.count_transfers() as transfers:
        outputs, ctx = row.forward(**device, **options)
        row.backward(ctx, *upstream)
    flat_outputs(outputs)
    return {"total": transfers.total, "uploads": transfers.uploads}


def test_arrays_cross_by_dlpack_without_a_copy(cuda_route, monkeypatch):
    op = rt.op("normalize.l2_normalize")
    seen = {}
    forward = op.spec.forward

    def spy(**arrays):
        seen["x"] = arrays["x"]
        return forward(**arrays)

    import dataclasses
    monkeypatch.setattr(op, "spec", dataclasses.replace(op.spec, forward=spy))
    x = torch.randn(6, 4, dtype=torch.float32, requires_grad=True)
    d_y = torch.full((6, 4), 0.5)
    # Twice directly (the first call uploads the fast path's cached constants), then through
    # the bridge.
    for _ in range(2):
        own = _fast_path_transfers("normalize.l2_normalize", {"x": x.detach().numpy()}, {},
                                   [d_y.numpy()])
    with cupy_standin.count_transfers() as transfers:
        y = op(x)
        (d_x,) = torch.autograd.grad(y, x, d_y)
    assert isinstance(seen["x"], cupy_standin.ndarray)
    assert seen["x"].__cuda_array_interface__["data"][0] == x.data_ptr()
    assert {"total": transfers.total, "uploads": transfers.uploads} == own, transfers
    expected = x.detach().numpy() / np.linalg.norm(x.detach().numpy(), axis=1, keepdims=True)
    assert_allclose(y.detach().numpy(), expected, rtol=1e-6)


def test_gsp_pool_on_the_cuda_route_adds_no_transfer(cuda_route, no_data_checks):
    rng = np.random.default_rng(0)
    features = torch.from_numpy(rng.standard_normal((4, 9, 3)).astype(np.float32))
    prototypes = torch.from_numpy(rng.standard_normal((5, 3)).astype(np.float32))
    features.requires_grad_()
    prototypes.requires_grad_()
    d_pooled, d_z = torch.full((4, 3), 0.3), torch.full((4, 5), -0.2)
    for _ in range(2):
        own = _fast_path_transfers(
            "gsp.pool",
            {"features": features.detach().numpy(), "prototypes": prototypes.detach().numpy()},
            {"mu": 0.4, "inverse_temperature": 3.0}, [d_pooled.numpy(), d_z.numpy()])
    with cupy_standin.count_transfers() as transfers:
        pooled, z = rt.op("gsp.pool")(features, prototypes, mu=0.4, inverse_temperature=3.0)
        grads = torch.autograd.grad((pooled, z), (features, prototypes), (d_pooled, d_z))
    # The handle's ticket is a host integer, not a device read: what the layer reads back is
    # what refdml's CuPy path reads back.
    assert {"total": transfers.total, "uploads": transfers.uploads} == own, transfers
    assert own["uploads"] == 0
    (ref_pooled, ref_z), ctx = gsp_pool_forward(features.detach().double().numpy(),
                                                prototypes.detach().double().numpy(),
                                                mu=0.4, inverse_temperature=3.0)
    ref = gsp_pool_backward(ctx, d_pooled.double().numpy(), d_z.double().numpy())
    assert_allclose(pooled.detach().numpy(), ref_pooled, rtol=1e-4, atol=1e-6)
    assert_allclose(z.detach().numpy(), ref_z, rtol=1e-4, atol=1e-6)
    assert_allclose(grads[0].numpy(), ref.features, rtol=1e-3, atol=1e-5)
    assert_allclose(grads[1].numpy(), ref.prototypes, rtol=1e-3, atol=1e-5)
