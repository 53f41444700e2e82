"""refdml.torch on a real GPU (skipped without CUDA in torch and CuPy; scripts/gpu_run.sh
runs this file on a lent GPU): CUDA tensors cross to CuPy by DLPack without a copy, refdml
runs on PyTorch's current stream, and the values and gradients are the reference's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from numpy.testing import assert_allclose

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA in torch", allow_module_level=True)
cupy = pytest.importorskip("cupy")
if getattr(cupy, "__refdml_standin__", False):
    pytest.skip("needs the real CuPy, not the stand-in", allow_module_level=True)

import refdml.torch as rt  # noqa: E402
from refdml.gsp import gsp_pool_backward, gsp_pool_forward  # noqa: E402


def test_gsp_pool_on_cuda_shares_memory_runs_on_the_current_stream_and_is_the_reference(
        monkeypatch):
    op = rt.op("gsp.pool")
    seen = {}
    forward = op.spec.forward

    def spy(**arrays):
        seen["features"] = arrays["features"]
        seen["stream"] = cupy.cuda.get_current_stream().ptr
        return forward(**arrays)

    monkeypatch.setattr(op, "spec", dataclasses.replace(op.spec, forward=spy))
    rng = np.random.default_rng(0)
    f64 = rng.standard_normal((8, 49, 16))
    p64 = rng.standard_normal((12, 16))
    features = torch.tensor(f64, dtype=torch.float32, device="cuda", requires_grad=True)
    prototypes = torch.tensor(p64, dtype=torch.float32, device="cuda", requires_grad=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pooled, z = op(features, prototypes, mu=0.3, inverse_temperature=5.0)
        d_pooled, d_z = torch.ones_like(pooled) * 0.3, torch.ones_like(z) * -0.2
        grads = torch.autograd.grad((pooled, z), (features, prototypes), (d_pooled, d_z))
    stream.synchronize()
    assert seen["features"].data.ptr == features.data_ptr()
    assert seen["stream"] == stream.cuda_stream
    assert pooled.device.type == "cuda" and pooled.dtype == torch.float32
    (ref_pooled, ref_z), ctx = gsp_pool_forward(f64.astype(np.float32).astype(np.float64),
                                                p64.astype(np.float32).astype(np.float64),
                                                mu=0.3, inverse_temperature=5.0)
    ref = gsp_pool_backward(ctx, np.full(ref_pooled.shape, 0.3), np.full(ref_z.shape, -0.2))
    assert_allclose(pooled.detach().cpu().numpy(), ref_pooled, rtol=1e-4, atol=1e-5)
    assert_allclose(z.detach().cpu().numpy(), ref_z, rtol=1e-4, atol=1e-5)
    assert_allclose(grads[0].cpu().numpy(), ref.features, rtol=1e-3, atol=1e-4)
    assert_allclose(grads[1].cpu().numpy(), ref.prototypes, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_loss_on_cuda_is_a_tensor_on_the_device_in_its_dtype(dtype):
    embeddings = torch.randn(16, 8, device="cuda", dtype=dtype, requires_grad=True)
    labels = torch.arange(4, device="cuda").repeat(4)
    loss = rt.ProxyAnchorLoss(4, 8, dtype=dtype).to("cuda")(embeddings, labels)
    assert loss.device.type == "cuda" and loss.dtype == dtype and loss.dim() == 0
    loss.backward()
    assert embeddings.grad.dtype == dtype and torch.isfinite(embeddings.grad.float()).all()
