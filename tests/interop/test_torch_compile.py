"""``torch.compile(model, fullgraph=True)`` over refdml's custom ops gives the eager values
and gradients: the ops trace as opaque nodes (their ``register_fake`` shapes), the
hyperparameters as a constant string, and the backward through the saved handle."""

from __future__ import annotations

import pytest
from numpy.testing import assert_allclose

torch = pytest.importorskip("torch")

import refdml.torch as rt  # noqa: E402
from refdml.torch._ops import live_contexts  # noqa: E402


class _Net(torch.nn.Module):
    """A linear map, GSP pooling, L2 normalisation and a proxy loss."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4, dtype=torch.float64)
        self.pool = rt.GSPPool(5, 4, mu=0.4, inverse_temperature=3.0, dtype=torch.float64)
        self.normalize = rt.L2Normalize()
        self.loss = rt.ProxyAnchorLoss(3, 4, dtype=torch.float64, alpha=8.0)

    def forward(self, x, labels):
        pooled, _ = self.pool(self.linear(x))
        return self.loss(self.normalize(pooled), labels)


def _values_and_grads(model, x, labels):
    model.zero_grad()
    loss = model(x, labels)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_gives_the_eager_values(backend):
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(6, 7, 3, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    eager_loss, eager_grads = _values_and_grads(model, x, labels)
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    for _ in range(2):   # the second call replays the compiled graph
        loss, grads = _values_and_grads(compiled, x, labels)
        assert_allclose(loss, eager_loss, rtol=1e-13)
        for got, want in zip(grads, eager_grads):
            assert_allclose(got.numpy(), want.numpy(), rtol=1e-11, atol=1e-14)
    import gc
    gc.collect()
    assert live_contexts() == 0


def test_changing_a_hyperparameter_recompiles_rather_than_reusing_the_graph():
    # Hyperparameters are constants of the traced code (here a module's attributes), baked
    # into the graph as a string: a new value must fail the guard and recompile.
    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 2])
    loss = rt.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5)
    # dynamic=False: a float that changed between calls is otherwise traced as a symbolic
    # value on the recompile (automatic dynamic), which no string can hold (docs/torch.md).
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=False)
    values = []
    for margin in (0.5, 1.5):
        loss.options["neg_margin"] = margin
        values.append(float(compiled(x, labels)))
        assert_allclose(values[-1], float(loss(x, labels)), rtol=1e-14)
    assert values[0] != values[1]
