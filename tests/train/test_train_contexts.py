"""Contexts name the object whose forward made them by a token that cannot be reused (issue 20).

``id(owner)`` is an address: once the owner is garbage-collected a new object may be given
it, and a backward that compared ids would take the dead owner's context as its own (a
proxy loss would add the old batch's gradients to the new proxies). Each test below builds
an owner, keeps a context of it, frees the owner, builds a new one AT THE SAME ADDRESS and
checks that the new owner refuses the old context; and that a live owner refuses the
context of another live owner of the same kind.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest

from refdml.train import GSPHead, L2Normalize, Linear, ReLU, Sequential, XMLHistogramHead
from refdml.train.objectives import (
    ASAPObjective,
    GSPObjective,
    LossObjective,
    WassersteinObjective,
    XMLObjective,
)
from refdml.train.plots import gsp_weights

REFUSED = r"ctx was returned by the forward of another object"

_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((4, 3))
FEATURES = np.abs(_RNG.standard_normal((4, 5, 3))) + 0.1
Y = X / np.linalg.norm(X, axis=1, keepdims=True)
Z = np.abs(_RNG.standard_normal((4, 6)))
LABELS = np.array([0, 0, 1, 1])


def _ones_like(outputs):
    if isinstance(outputs, tuple):
        return tuple(np.ones_like(o) for o in outputs)
    return np.ones_like(outputs)


# Each case: (class, args, kwargs) of an owner, its forward's context, and its backward.
LINEAR = Linear(3, 2, rng=0)
LAYER_CASES = {
    "Sequential": (Sequential, ([LINEAR, ReLU()],), {}, X),
    "GSPHead": (GSPHead, (6, 3), dict(mu=0.5, inverse_temperature=1.0, rng=0), FEATURES),
    "XMLHistogramHead": (XMLHistogramHead, (6, 3), dict(inverse_temperature=1.0, rng=0),
                         FEATURES),
    "L2Normalize": (L2Normalize, (), {}, X),
}
OBJECTIVE_CASES = {
    "LossObjective": (LossObjective, ("proxy_nca",), dict(n_classes=2, dim=3, rng=0), Y),
    "GSPObjective": (GSPObjective, ("contrastive",), dict(n_classes=2, attribute_dim=6, rng=0),
                     (Y, Z)),
    "XMLObjective": (XMLObjective, (), dict(lambda_=0.5, ridge=0.1, rng=0), (Y, Z)),
    "WassersteinObjective": (WassersteinObjective, (), dict(margin=1.0, eps=0.5), FEATURES),
    "ASAPObjective": (ASAPObjective, ("proxy_nca",),
                      dict(n_classes=2, dim=3, proxies_per_class=1, budget=2, lambda_=0.1,
                           model_parameters=list(LINEAR.parameters()), rng=0), Y),
}


def _forward(owner, inputs):
    if isinstance(owner, (Sequential, GSPHead, XMLHistogramHead, L2Normalize)):
        outputs, ctx = owner.forward(inputs)
        return ctx, _ones_like(outputs)
    _, ctx = owner.forward(inputs, LABELS)
    return ctx, 1.0


def _backward(owner, ctx, upstream):
    if isinstance(upstream, tuple) and isinstance(owner, GSPHead):
        return owner.backward(ctx, upstream)
    return owner.backward(ctx, upstream)


def _rebuilt_at_the_same_address(cls, args, kwargs, inputs):
    """``(context of a freed owner, a new owner built at that owner's address)``.

    CPython's allocator hands freed blocks back to later allocations of the same size:
    uninitialised instances (``cls.__new__``) are made, and kept so that each takes a new
    block, until one sits at the dead owner's address (usually the first; when the free
    emptied its memory pool, once the pool is reused). Checked, not assumed: the test is
    skipped on an interpreter that never hands the address back.
    """
    gc.collect()
    old = cls(*args, **kwargs)
    ctx, upstream = _forward(old, inputs)
    address = id(old)
    alive = weakref.ref(old)
    # Allocated before the free, so that nothing but the instances takes the freed block.
    placeholders = [None] * 100_000
    del old  # no cycle holds an owner: reference counting frees it here
    assert alive() is None
    for k in range(len(placeholders)):
        new = cls.__new__(cls)
        if id(new) == address:
            break
        placeholders[k] = new
    else:
        pytest.skip("this interpreter did not reuse the freed owner's address")
    del placeholders
    new.__init__(*args, **kwargs)
    return ctx, upstream, new


@pytest.mark.parametrize("case", sorted(LAYER_CASES) + sorted(OBJECTIVE_CASES))
def test_a_new_owner_at_a_dead_owners_address_refuses_its_context(case):
    cls, args, kwargs, inputs = {**LAYER_CASES, **OBJECTIVE_CASES}[case]
    ctx, upstream, new = _rebuilt_at_the_same_address(cls, args, kwargs, inputs)
    with pytest.raises(ValueError, match=REFUSED):
        _backward(new, ctx, upstream)
    # Nothing was accumulated before the refusal (a proxy loss's proxies above all).
    for parameter in new.parameters():
        assert not np.any(parameter.grad), parameter.name


@pytest.mark.parametrize("case", sorted(LAYER_CASES) + sorted(OBJECTIVE_CASES))
def test_owners_are_told_apart_even_if_every_address_were_the_same(case, monkeypatch):
    # The deterministic form of the reuse above: in the modules that make and check
    # contexts, id() answers one address for every object, as it would for two objects
    # that lived at the same address one after the other.
    import refdml.train._heads
    import refdml.train._layer
    import refdml.train.objectives._base
    import refdml.train.plots

    for module in (refdml.train._layer, refdml.train._heads, refdml.train.objectives._base,
                   refdml.train.plots):
        monkeypatch.setattr(module, "id", lambda obj: 0x1000, raising=False)
    cls, args, kwargs, inputs = {**LAYER_CASES, **OBJECTIVE_CASES}[case]
    first, second = cls(*args, **kwargs), cls(*args, **kwargs)
    ctx, upstream = _forward(first, inputs)
    with pytest.raises(ValueError, match=REFUSED):
        _backward(second, ctx, upstream)


@pytest.mark.parametrize("case", sorted(LAYER_CASES) + sorted(OBJECTIVE_CASES))
def test_a_live_owner_refuses_another_owners_context_and_takes_its_own(case):
    cls, args, kwargs, inputs = {**LAYER_CASES, **OBJECTIVE_CASES}[case]
    first, second = cls(*args, **kwargs), cls(*args, **kwargs)
    ctx, upstream = _forward(first, inputs)
    with pytest.raises(ValueError, match=REFUSED):
        _backward(second, ctx, upstream)
    # A deep copy is another object: its contexts are not the original's, either way.
    twin = copy.deepcopy(first)
    with pytest.raises(ValueError, match=REFUSED):
        _backward(twin, ctx, upstream)
    _backward(first, ctx, upstream)


def test_the_refusal_names_both_owners():
    model = Sequential([Linear(3, 2, rng=0)], name="student")
    other = Sequential([Linear(3, 2, rng=0)], name="teacher")
    _, ctx = other.forward(X)
    with pytest.raises(ValueError, match=r"another object \(Sequential 'teacher'\), not by this "
                                         r"Sequential 'student'"):
        model.backward(ctx, np.ones((4, 2)))


def test_gsp_weights_refuses_the_context_of_a_dead_model_at_the_same_address():
    head_args = (6, 3)
    head_kwargs = dict(mu=0.5, inverse_temperature=1.0, rng=0)
    ctx, _, new_head = _rebuilt_at_the_same_address(GSPHead, head_args, head_kwargs, FEATURES)
    with pytest.raises(ValueError, match=REFUSED):
        gsp_weights(new_head, ctx)
    layers = [GSPHead(*head_args, **head_kwargs)]
    ctx, _, new_model = _rebuilt_at_the_same_address(Sequential, (layers,), {}, FEATURES)
    with pytest.raises(ValueError, match=REFUSED):
        gsp_weights(new_model, ctx)


def test_a_model_whose_layers_were_replaced_refuses_its_old_context():
    model = Sequential([Linear(3, 2, rng=0), ReLU()])
    _, ctx = model.forward(X)
    model.layers = model.layers[:1]
    with pytest.raises(ValueError, match="holds 2 layer contexts, this model has 1"):
        model.backward(ctx, np.ones((4, 2)))
