"""refdml.torch's ``nn.Module`` classes: parameters where PyTorch users expect them, the
ops' values, and the refusals of their constructors."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

torch = pytest.importorskip("torch")

import refdml.torch as rt  # noqa: E402
from refdml.gsp import gsp_pool_forward  # noqa: E402
from refdml.losses import proxy_nca_forward  # noqa: E402
from refdml.ot import pairwise_sinkhorn_divergence_forward, sinkhorn_divergence_forward  # noqa: E402


def test_gsp_pool_holds_its_prototypes_as_a_parameter_and_pools_as_the_reference():
    torch.manual_seed(0)
    layer = rt.GSPPool(5, 3, mu=0.3, inverse_temperature=4.0, dtype=torch.float64)
    assert isinstance(layer.prototypes, torch.nn.Parameter)
    assert tuple(layer.prototypes.shape) == (5, 3)
    assert set(layer.state_dict()) == {"prototypes"}
    assert "mu=0.3" in repr(layer) and "inverse_temperature=4.0" in repr(layer)
    features = torch.randn(4, 6, 3, dtype=torch.float64)
    pooled, z = layer(features)
    (ref_pooled, ref_z), _ = gsp_pool_forward(features.numpy(), layer.prototypes.detach().numpy(),
                                              mu=0.3, inverse_temperature=4.0)
    assert_allclose(pooled.detach().numpy(), ref_pooled, rtol=1e-12)
    assert_allclose(z.detach().numpy(), ref_z, rtol=1e-12)
    (pooled.sum() + z.sum()).backward()
    assert layer.prototypes.grad is not None and torch.isfinite(layer.prototypes.grad).all()


def test_given_prototypes_are_copied_and_checked():
    values = torch.randn(4, 2, dtype=torch.float64)
    layer = rt.GSPPool(4, 2, mu=0.5, inverse_temperature=1.0, prototypes=values)
    assert torch.equal(layer.prototypes.detach(), values)
    assert layer.prototypes.data_ptr() != values.data_ptr()
    with pytest.raises(ValueError, match=r"prototypes has shape \(4, 2\), expected .* \(3, 2\)"):
        rt.GSPPool(3, 2, mu=0.5, inverse_temperature=1.0, prototypes=values)
    with pytest.raises(TypeError, match=r"prototypes must be a torch.Tensor, got ndarray"):
        rt.GSPPool(4, 2, mu=0.5, inverse_temperature=1.0, prototypes=values.numpy())
    with pytest.raises(ValueError, match=r"n_prototypes == 0, must be >= 1"):
        rt.GSPPool(0, 2, mu=0.5, inverse_temperature=1.0)
    with pytest.raises(TypeError, match=r"dim must be an int, got float"):
        rt.GSPPool(3, 2.0, mu=0.5, inverse_temperature=1.0)


def test_a_proxy_loss_learns_its_proxies():
    torch.manual_seed(1)
    loss = rt.ProxyNCALoss(3, 4, proxies_per_class=2, dtype=torch.float64, temperature=0.5)
    assert isinstance(loss.proxies, torch.nn.Parameter) and tuple(loss.proxies.shape) == (6, 4)
    assert loss.proxy_labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert "proxy_labels" in loss.state_dict()
    embeddings = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 0, 1])
    value = loss(embeddings, labels)
    ref, _ = proxy_nca_forward(embeddings.detach().numpy(), labels.numpy(),
                               proxies=loss.proxies.detach().numpy(),
                               proxy_labels=loss.proxy_labels.numpy(), temperature=0.5)
    assert_allclose(float(value.detach()), ref, rtol=1e-12)
    value.backward()
    assert loss.proxies.grad is not None and embeddings.grad is not None
    with pytest.raises(ValueError, match=r"proxies_per_class == 0"):
        rt.ProxyAnchorLoss(3, 4, proxies_per_class=0)


def test_sinkhorn_divergence_module_batches_and_the_pairwise_one_matches():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 2, dtype=torch.float64)
    y = torch.randn(3, 4, 2, dtype=torch.float64)
    module = rt.SinkhornDivergence(eps=0.5, p=2, tol=1e-12)
    batched = module(x, y)
    assert tuple(batched.shape) == (3,)
    for k in range(3):
        ref, _ = sinkhorn_divergence_forward(x[k].numpy(), y[k].numpy(), eps=0.5, p=2, tol=1e-12)
        assert_allclose(float(batched[k]), ref, rtol=1e-10)
        assert_allclose(float(module(x[k], y[k])), ref, rtol=1e-10)
    with pytest.raises(ValueError, match=r"y must be \(B, m, d\) with the same B"):
        module(x, y[:2])
    pairwise = rt.PairwiseSinkhornDivergence(eps=0.5, p=2, tol=1e-12)(x)
    ref, _ = pairwise_sinkhorn_divergence_forward(x.numpy(), eps=0.5, p=2, tol=1e-12)
    assert_allclose(pairwise.numpy(), ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("module, args", [
    (lambda: rt.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0), "pair"),
    (lambda: rt.TripletLoss(margin=0.2), "pair"),
    (lambda: rt.MultiSimilarityLoss(), "pair"),
    (lambda: rt.GeneralizedContrastiveLoss(alpha=0.3, beta=0.6), "pair"),
    (lambda: rt.ProxyAnchorLoss(3, 4, dtype=torch.float64), "pair"),
    (lambda: rt.SoftTripleLoss(3, 4, proxies_per_class=2, dtype=torch.float64), "pair"),
    (lambda: rt.ProxyContrastiveLoss(3, 4, dtype=torch.float64), "pair"),
    (lambda: rt.ProxyMultiSimilarityLoss(3, 4, dtype=torch.float64), "pair"),
    (lambda: rt.L2Normalize(), "x"),
    (lambda: rt.ClipNormalize(), "x"),
    (lambda: rt.WContrastiveLoss(margin=5.0, eps=0.5), "clouds"),
    (lambda: rt.WTripletLoss(margin=5.0, eps=0.5), "clouds"),
    (lambda: rt.XMLLoss(ridge=0.2), "xml"),
    (lambda: rt.ZeroShotLoss(), "zero_shot"),
])
def test_every_module_runs_forward_and_backward(module, args):
    torch.manual_seed(3)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    embeddings = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    inputs = {
        "pair": (embeddings, labels),
        "x": (embeddings,),
        "clouds": (torch.randn(6, 3, 2, dtype=torch.float64, requires_grad=True), labels),
        "xml": (embeddings, torch.randn(6, 3, dtype=torch.float64), labels),
        "zero_shot": (embeddings, labels, torch.randn(3, 5, dtype=torch.float64)),
    }[args]
    out = module()(*inputs)
    out.sum().backward() if out.dim() else out.backward()
    assert inputs[0].grad is not None and torch.isfinite(inputs[0].grad).all()
    assert np.isfinite(out.detach().numpy()).all()
