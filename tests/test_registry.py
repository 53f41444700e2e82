"""Every registered operator passes its gradient check; every operator module registers one."""

import importlib

import pytest

from refdml.gradcheck import assert_gradients
from refdml.gradcheck.registry import OPERATOR_MODULES, all_operators

SPECS = all_operators()


@pytest.mark.parametrize("module", OPERATOR_MODULES)
def test_every_operator_module_registers_something(module):
    importlib.import_module(module)
    prefix = module.removeprefix("refdml.") + "."
    assert any(s.name.startswith(prefix) for s in SPECS), f"{module} registers no operator"


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.parametrize("seed", [0, 1])
def test_registered_operator_gradients(spec, seed):
    assert spec.paper, f"{spec.name} does not name the paper equation it implements"
    assert_gradients(spec.check(seed), rtol=spec.rtol, atol=spec.atol)
