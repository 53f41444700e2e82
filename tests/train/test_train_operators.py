"""refdml.train's operator table: REFERENCE holds the float64 reference operators, FAST their
refdml.gpu mirrors (the same functions the fast path ran before the table), and the layers
and objectives take their pairs from the table their ``reference`` flag names."""

from __future__ import annotations

import numpy as np
import pytest

import refdml.crossbatch
import refdml.gpu.crossbatch
import refdml.gpu.gsp
import refdml.gpu.histogram
import refdml.gpu.losses
import refdml.gpu.normalize
import refdml.gpu.ot
import refdml.gsp
import refdml.histogram
import refdml.losses
import refdml.normalize
import refdml.ot
from refdml.train import GSPHead, L2Normalize, XMLHistogramHead
from refdml.train._operators import FAST, REFERENCE, check_reference, operators
from refdml.train.objectives import (
    LOSSES,
    PROXY_LOSSES,
    GSPObjective,
    LossObjective,
    WassersteinObjective,
    XMLObjective,
)

# table field -> (family, the operator's name in that family), written out here rather than
# read from the table, so that a swapped or missing entry fails
FIELDS = {"gsp_pool": ("gsp", "gsp_pool"),
          "histogram_entropic": ("histogram", "histogram_entropic"),
          "l2_normalize": ("normalize", "l2_normalize"),
          "zero_shot_loss": ("crossbatch", "zero_shot_loss"),
          "xml_loss": ("crossbatch", "xml_loss"),
          "wcontrastive": ("ot", "wcontrastive"),
          "wtriplet": ("ot", "wtriplet")}
MODULES = {
    "reference": {"gsp": refdml.gsp, "histogram": refdml.histogram,
                  "normalize": refdml.normalize, "losses": refdml.losses,
                  "crossbatch": refdml.crossbatch, "ot": refdml.ot},
    "fast": {"gsp": refdml.gpu.gsp, "histogram": refdml.gpu.histogram,
             "normalize": refdml.gpu.normalize, "losses": refdml.gpu.losses,
             "crossbatch": refdml.gpu.crossbatch, "ot": refdml.gpu.ot},
}


@pytest.mark.parametrize("table", [REFERENCE, FAST], ids=lambda t: t.name)
def test_each_entry_is_that_implementations_function(table):
    modules = MODULES[table.name]
    for field, (family, name) in FIELDS.items():
        pair = getattr(table, field)
        assert pair.forward is getattr(modules[family], f"{name}_forward"), field
        assert pair.backward is getattr(modules[family], f"{name}_backward"), field
    assert set(table.losses) == set(LOSSES)
    for loss in LOSSES:
        assert table.loss(loss).forward is getattr(modules["losses"], f"{loss}_forward")
        assert table.loss(loss).backward is getattr(modules["losses"], f"{loss}_backward")
    assert set(table.one_call_losses) == set(LOSSES) - set(PROXY_LOSSES)
    for loss in table.one_call_losses:
        assert table.one_call_loss(loss) is getattr(modules["losses"], loss)


def test_the_two_tables_share_no_function():
    for field in FIELDS:
        assert getattr(FAST, field).forward is not getattr(REFERENCE, field).forward, field
    for loss in LOSSES:
        assert FAST.loss(loss).forward is not REFERENCE.loss(loss).forward, loss


def test_operators_picks_the_table_and_refuses_a_non_bool():
    assert operators(True) is REFERENCE and operators(False) is FAST
    for bad in (1, 0, "true", None, np.bool_(True)):
        with pytest.raises(TypeError, match="reference must be a bool"):
            operators(bad)
        with pytest.raises(TypeError, match="reference must be a bool"):
            check_reference(bad)


def test_unknown_loss_is_a_named_error():
    with pytest.raises(ValueError, match=r"loss == 'hinge', must be one of"):
        FAST.loss("hinge")
    with pytest.raises(ValueError, match=r"base == 'proxy_nca', must be one of"):
        REFERENCE.one_call_loss("proxy_nca")
    with pytest.raises(TypeError, match="loss must be one of"):
        FAST.loss(None)


@pytest.mark.parametrize("reference", [False, True])
def test_layers_and_objectives_run_the_table_their_flag_names(reference, monkeypatch):
    """Each forward and backward asks :func:`operators` for the table of its flag (the
    default, ``reference=False``, is FAST: the refdml.gpu mirrors, as before the table)."""
    import refdml.train._heads as heads
    import refdml.train.objectives._crossbatch as crossbatch
    import refdml.train.objectives._loss as loss_module
    import refdml.train.objectives._wasserstein as wasserstein

    asked = []

    def spy(flag):
        asked.append(flag)
        return operators(flag)

    for module in (heads, crossbatch, loss_module, wasserstein):
        monkeypatch.setattr(module, "operators", spy)
    table = REFERENCE if reference else FAST
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5))
    labels = np.array([0, 0, 1, 1])
    split = np.array([True, True, False, False])
    for layer in (GSPHead(2, 5, mu=0.3, inverse_temperature=5.0, reference=reference, rng=1),
                  XMLHistogramHead(2, 5, inverse_temperature=5.0, reference=reference, rng=1)):
        y, ctx = layer.forward(x)
        layer.backward(ctx, (np.ones_like(y[0]), None) if isinstance(y, tuple)
                       else np.ones_like(y))
    l2 = L2Normalize(reference=reference)
    y, ctx = l2.forward(x[:, 0])
    l2.backward(ctx, np.ones_like(y))
    n_layer_calls = len(asked)
    assert n_layer_calls == 6
    triplet = LossObjective("triplet", reference=reference)
    assert triplet._forward is table.loss("triplet").forward
    assert triplet._backward is table.loss("triplet").backward
    xml = XMLObjective("contrastive", lambda_=0.5, ridge=0.05, reference=reference)
    assert xml.base_loss is table.one_call_loss("contrastive")
    y = x[:, 0] / np.linalg.norm(x[:, 0], axis=1, keepdims=True)
    z = np.full((4, 3), 1.0 / 3.0) + 0.1 * rng.random((4, 3))
    for objective, outputs in (
            (GSPObjective("contrastive", n_classes=2, attribute_dim=5, rng=0,
                          reference=reference), (y, z)),
            (WassersteinObjective("triplet", margin=0.1, eps=0.5, max_iter=5, tol=0.0,
                                  reference=reference), x)):
        kwargs = {"split": split} if isinstance(objective, GSPObjective) else {}
        _, octx = objective.forward(outputs, labels, **kwargs)
        objective.backward(octx, 0.5)
    assert len(asked) > n_layer_calls + 3
    assert set(asked) == {reference}
