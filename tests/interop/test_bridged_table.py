"""The bridges' table (:data:`refdml._interop.BRIDGED`) against the catalogue, which it
does not import: every name it serves is a catalogue entry whose mirror is the row's pair,
and every catalogue operator a model uses is bridged or excluded here with a reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from refdml import catalog
from refdml._interop import BRIDGED, bridged, broadcast, decode_options, encode_options

# Catalogue entries deliberately not bridged, and why.
NOT_BRIDGED = {
    "train": "refdml.train's layers (conv2d, linear, relu, pooling, embedding) are PyTorch's own",
    "gsp.weight_transport": "its catalogue mirror is an adapter of the catalogue's; a model "
                            "uses gsp.pool or gsp.cost_map",
}


def _excluded(spec) -> bool:
    return spec.family in NOT_BRIDGED or spec.name in NOT_BRIDGED or spec.mirror is None


@pytest.mark.parametrize("name", sorted({n for row in BRIDGED.values()
                                         for n in row.catalogue_names}))
def test_every_bridged_name_is_a_catalogue_entry_mirrored_by_the_row(name):
    spec, row = catalog.get(name), bridged(name)
    assert spec.mirror is row.forward and spec.mirror_backward is row.backward, name
    inputs = spec.make_inputs(np.random.default_rng(0))
    arrays = {k for k, v in inputs.items() if isinstance(v, np.ndarray)}
    assert arrays <= set(row.arrays), f"{name}: arrays {arrays - set(row.arrays)} not in the row"
    floating = {k for k in arrays if np.issubdtype(inputs[k].dtype, np.floating)}
    assert set(spec.wrt or floating) <= set(row.differentiable)


@pytest.mark.parametrize("name", sorted({n for row in BRIDGED.values()
                                         for n in row.catalogue_names}))
def test_output_shapes_are_the_forwards(name):
    spec, row = catalog.get(name), bridged(name)
    inputs = spec.make_inputs(np.random.default_rng(1))
    outputs, _ = row.forward(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    shapes = {k: (np.shape(inputs[k]) if k in inputs else None) for k in row.arrays}
    shapes["options"] = {k: v for k, v in inputs.items() if k not in row.arrays}
    assert row.output_shapes(shapes) == tuple(np.shape(o) for o in outputs)


def test_every_model_operator_of_the_catalogue_is_bridged():
    served = {n for row in BRIDGED.values() for n in row.catalogue_names}
    missing = [s.name for s in catalog.all_operators() if not _excluded(s) and s.name not in served]
    assert not missing, f"catalogue operators neither bridged nor excluded with a reason: {missing}"


def test_a_misspelt_name_is_refused_with_the_closest():
    with pytest.raises(ValueError, match=r"name == 'gsp.pol'.*did you mean 'gsp.pool'"):
        bridged("gsp.pol")
    with pytest.raises(TypeError, match="name must be a catalogue name"):
        bridged(3)


def test_options_round_trip_exactly_and_refuse_what_cannot_cross():
    options = {"mu": 0.1 + 0.2, "eps": 1e-300, "big": 1e300, "n": np.int64(7), "form": "cosine",
               "kw": {"pos_margin": 0.0, "neg_margin": 100.0}, "none": None, "inf": float("inf")}
    back = decode_options(encode_options(options))
    assert back["mu"] == 0.1 + 0.2 and back["eps"] == 1e-300 and back["big"] == 1e300
    assert back["n"] == 7 and back["kw"] == options["kw"] and back["none"] is None
    assert back["inf"] == float("inf")
    assert json.loads(encode_options({"b": 1, "a": 2})) == {"a": 2, "b": 1}
    with pytest.raises(TypeError, match=r"rng is a Generator"):
        encode_options({"rng": np.random.default_rng(0)})
    with pytest.raises(TypeError, match=r"base_loss is a function"):
        encode_options({"base_loss": lambda *a: a})


@pytest.mark.parametrize("shapes", [((2, 1), (1, 3)), ((3,), (4, 1)), ((), (2,)), ((1,), (1,)),
                                    ((5, 1, 2), (3, 1))])
def test_broadcast_is_numpys(shapes):
    assert broadcast(*shapes) == np.broadcast_shapes(*shapes)
