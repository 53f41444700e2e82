"""The operator catalogue: every entry passes its gradient check, and nothing escapes it."""

import ast
import importlib
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml.gradcheck import assert_gradients
from refdml.catalog import FAMILIES, OperatorSpec, all_operators, get, register

SPECS = all_operators()
IDS = [s.name for s in SPECS]

# Every public module whose functions users call; each public backward must be catalogued.
PUBLIC_MODULES = (
    "refdml.normalize",
    "refdml.distances",
    "refdml.gsp",
    "refdml.histogram",
    "refdml.losses",
    "refdml.metrics",
    "refdml.prototypes",
    "refdml.crossbatch",
    "refdml.ot",
    "refdml.coresets",
    "refdml.kcenter",
    "refdml.train.layers",
)
PACKAGE = pathlib.Path(importlib.import_module("refdml").__file__).parent


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_catalogued_gradients_fixed_seeds(spec, seed):
    assert spec.paper, f"{spec.name} does not name the paper equation it implements"
    assert_gradients(spec.check(seed), rtol=spec.rtol, atol=spec.atol)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@settings(max_examples=4)
@given(seed=st.integers(min_value=2, max_value=2**32 - 1))
def test_catalogued_gradients_hypothesis_seeds(spec, seed):
    assert_gradients(spec.check(seed), rtol=spec.rtol, atol=spec.atol)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_entry_is_a_pair(spec):
    assert callable(spec.forward) and callable(spec.backward)
    inputs = dict(spec.make_inputs(np.random.default_rng(0)))
    outputs, ctx = spec.forward(**inputs)
    assert ctx is not None, f"{spec.name}: the forward returns no context"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_catalogues_something(family):
    assert any(s.family == family for s in SPECS), f"catalogue file {family} has no entry"


def _public_backwards():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            if "backward" in name and callable(getattr(module, name)):
                yield f"{module_name}.{name}", getattr(module, name)


@pytest.mark.parametrize("qualname, backward", list(_public_backwards()))
def test_every_public_backward_is_catalogued(qualname, backward):
    catalogued = {id(s.backward) for s in SPECS}
    assert id(backward) in catalogued, f"{qualname} is public but no catalogue entry checks it"


def _operator_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("catalog", "checks", "gradcheck", "validation", "gpu") or \
                relative.name == "cli.py":
            continue
        yield str(relative), path


@pytest.mark.parametrize("relative, path", list(_operator_sources()))
def test_operator_modules_import_no_harness(relative, path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert not name.startswith("refdml.gradcheck"), f"{relative} imports {name}"


def test_register_refuses_a_duplicate_name():
    spec = get("normalize.l2_normalize")
    clone = OperatorSpec(
        name=spec.name, forward=spec.forward, backward=spec.backward,
        make_inputs=spec.make_inputs, paper=spec.paper,
    )
    with pytest.raises(ValueError, match="already in the catalogue"):
        register(clone)
    with pytest.raises(TypeError, match="OperatorSpec"):
        register("normalize.l2_normalize")


def test_a_mirror_is_a_pair_of_callables():
    spec = get("normalize.l2_normalize")
    fields = dict(name="zztest.op", forward=spec.forward, backward=spec.backward,
                  make_inputs=spec.make_inputs, paper="none")
    # A dotted name is no longer resolved later: it is refused when the entry is made.
    with pytest.raises(TypeError, match="mirror must be callable"):
        OperatorSpec(**fields, mirror="refdml.gpu.normalize.l2_normalize_forward",
                     mirror_backward=spec.mirror_backward)
    with pytest.raises(ValueError, match="mirror and mirror_backward go together"):
        OperatorSpec(**fields, mirror=spec.mirror)
    with pytest.raises(ValueError, match="mirror and mirror_backward go together"):
        OperatorSpec(**fields, mirror_backward=spec.mirror_backward)
    with pytest.raises(TypeError, match="forward must be callable"):
        OperatorSpec(**dict(fields, forward="refdml.normalize.l2_normalize_forward"))
    paired = OperatorSpec(**fields, mirror=spec.mirror, mirror_backward=spec.mirror_backward)
    assert paired.mirror_pair() == (spec.mirror, spec.mirror_backward)
    assert OperatorSpec(**fields).mirror_pair() is None


def test_get_names_the_known_operators():
    with pytest.raises(ValueError, match="no operator named 'nope'"):
        get("nope")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_backward_rejects_a_foreign_context_and_bad_upstream(spec):
    """Every backward checks what it is handed (TypeError / ValueError naming it)."""
    inputs = dict(spec.make_inputs(np.random.default_rng(0)))
    outputs, ctx = spec.forward(**inputs)
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    good = [np.ones(np.shape(o)) for o in outs]
    with pytest.raises(TypeError):
        spec.backward(object(), *good)
    for k, o in enumerate(outs):
        shape = np.shape(o)
        wrong_shape = list(good)
        wrong_shape[k] = np.ones(shape + (2,))
        with pytest.raises(ValueError):
            spec.backward(ctx, *wrong_shape)
        with_nan = list(good)
        with_nan[k] = np.full(shape, np.nan)
        with pytest.raises(ValueError):
            spec.backward(ctx, *with_nan)
