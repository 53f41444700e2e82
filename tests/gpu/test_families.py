"""The kernel families of the fast path and their one registration (issue 45, items 1 and 4).

A kernel family is found by one line in :data:`refdml.gpu.families.KERNEL_FAMILIES`: a
synthetic family (an operator that doubles its input, with an array path, an ``@njit`` twin
and a ``@cuda.jit`` kernel defined here) is invisible to the compile check until it is
registered, and once registered the compile check lists its kernel, the catalogue derives its
entry's kernel variants from it, and the parity rule runs and holds each variant. The real
families are checked to be laid out alike: named as their package, members named
``ArrayPath`` / ``CpuPath`` / ``CudaPath``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from numba import njit

import refdml.gpu
from refdml._backend import get_backend
from refdml.catalog import OperatorSpec, kernel_family_problems
from refdml.gpu import _compile_check
from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu.families import KERNEL_FAMILIES
from refdml.gradcheck import parity

FAST_PATH = Path(refdml.gpu.__file__).parent


# ------------------------------------------------------------------ a synthetic family
@cuda_kernel(signatures={"float64": "void(float64[::1], float64[::1])",
                         "float32": "void(float32[::1], float32[::1])"}, family="synthetic")
def refdml_synthetic_double(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = x[i] + x[i]


@njit(cache=False)
def _double_cpu(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] + x[i]


RAN: list[str] = []


class ArrayPath:
    def double(self, backend, x):
        RAN.append("array")
        return x + x


class CpuPath:
    def double(self, backend, x):
        RAN.append("cpu")
        out = np.empty_like(x)
        _double_cpu(x, out)
        return out


class CudaPath:
    def double(self, backend, x):
        RAN.append("cuda")
        out = backend.xp.empty_like(x)
        cuda_launch(refdml_synthetic_double, max(1, math.ceil(x.shape[0] / BLOCK)), BLOCK, x, out)
        return out


SYNTHETIC = Implementations("synthetic", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
                            auto_numpy="array", auto_cupy="array")


def _reference_forward(x):
    return 2.0 * np.asarray(x, dtype=np.float64), None


def _reference_backward(ctx, d_y):
    return {"x": 2.0 * np.asarray(d_y, dtype=np.float64)}


def _mirror_forward(x):
    backend = get_backend(x)
    return SYNTHETIC.choose(x).double(backend, backend.xp.ascontiguousarray(x)), None


def _mirror_backward(ctx, d_y):
    return {"x": d_y + d_y}


SPEC = OperatorSpec(
    name="synthetic.double", forward=_reference_forward, backward=_reference_backward,
    make_inputs=lambda rng: {"x": rng.standard_normal(37)}, paper="a test of the registry",
    mirror=_mirror_forward, mirror_backward=_mirror_backward, kernel_family=SYNTHETIC)


def test_a_synthetic_family_is_seen_once_registered():
    # Unregistered: the compile check does not know its kernel, and the catalogue says its
    # entry's family is not registered (its variants would escape the compile check).
    assert "refdml_synthetic_double" not in _compile_check.registry()
    assert kernel_family_problems([SPEC]) == [
        "synthetic.double: its kernel family 'synthetic' is not registered in "
        "refdml.gpu.families.KERNEL_FAMILIES"]
    with KERNEL_FAMILIES.registered(SYNTHETIC):
        assert KERNEL_FAMILIES["synthetic"] is SYNTHETIC
        assert _compile_check.signatures_of("refdml_synthetic_double") == [
            "void(float64[::1], float64[::1])", "void(float32[::1], float32[::1])"]
        assert kernel_family_problems([SPEC]) == []
        # The catalogue derives the entry's kernel variants from the family's object, and
        # the parity rule runs each one (the CUDA kernel under the simulator) and holds it
        # to the reference.
        assert SPEC.mirror_kernels == ("cpu", "cuda")
        assert parity.kernel_cases([SPEC]) == [(SPEC, "cpu"), (SPEC, "cuda")]
        for kernels in ("array", "cpu", "cuda"):
            RAN.clear()
            result = parity.check_parity(SPEC, dtype="float64", kernels=kernels,
                                         timing_repeats=0)
            assert result.passed, result.problems
            assert set(RAN) == {kernels}, (kernels, RAN)
    assert "synthetic" not in KERNEL_FAMILIES
    assert "refdml_synthetic_double" not in _compile_check.registry()


def test_a_family_is_registered_once():
    with pytest.raises(ValueError, match="kernel family 'gsp' is registered twice"):
        with KERNEL_FAMILIES.registered(KERNEL_FAMILIES["gsp"]):
            pass
    with pytest.raises(TypeError, match="a kernel family is an Implementations object"):
        with KERNEL_FAMILIES.registered("gsp"):
            pass


# ------------------------------------------------------------------ the real families
def test_every_family_package_is_registered_under_its_name():
    packages = sorted(p.parent.name for p in FAST_PATH.glob("*/_compiled.py"))
    assert packages == sorted(KERNEL_FAMILIES), "a family package missing from KERNEL_FAMILIES"
    for name, family in KERNEL_FAMILIES.items():
        assert family.family == name
        assert getattr(refdml.gpu, name).IMPLEMENTATIONS is family


def test_the_catalogue_takes_its_kernel_variants_from_registered_families_only():
    # Every entry with kernel variants names a registered family (the same object). The
    # families that serve no entry are the two whose operators are not differentiable
    # (retrieval metrics, greedy k-center), the optimiser's update (a step, not an
    # operator with a backward) and the products and Cholesky solves a captured step runs
    # (linalg: building blocks of other operators, chosen by the capture, not the mode):
    # the catalogue holds differentiable operators, and
    # tests/gpu/test_gpu_kernels_retrieval.py, test_gpu_kernels_kcenter.py,
    # tests/train/test_optim_fused.py and tests/gpu/test_gpu_kernels_linalg.py hold their
    # kernels to the reference or to NumPy instead. A new family lands in one of the two
    # groups.
    from refdml.catalog import all_operators

    assert kernel_family_problems() == []
    served = {spec.kernel_family.family for spec in all_operators()
              if spec.kernel_family is not None}
    assert served == set(KERNEL_FAMILIES) - {"metrics", "kcenter", "optim", "linalg"}, \
        sorted(served)


def test_every_family_names_its_members_alike():
    for name, family in KERNEL_FAMILIES.items():
        members = {"array": family.array, "cpu": family.cpu, "cuda": family.cuda}
        kinds = {kind: type(member).__name__ for kind, member in members.items()
                 if member is not None}
        assert kinds == {"array": "ArrayPath", "cpu": "CpuPath", "cuda": "CudaPath"}, name


def test_every_family_loads_its_compiled_modules_only_when_a_member_is_built():
    # In a fresh interpreter: importing the families loads no compiled module of theirs (no
    # Numba at all); building a family's CPU member loads its _compiled module and not its
    # CUDA kernels; building its CUDA member loads its _cuda module (and numba.cuda).
    import json
    import subprocess
    import sys

    code = """
import json, sys
from refdml.gpu.families import KERNEL_FAMILIES

def loaded(name):
    return {"numba": any(m.split(".")[0] == "numba" for m in sys.modules),
            "compiled": f"refdml.gpu.{name}._compiled" in sys.modules,
            "cuda": f"refdml.gpu.{name}._cuda" in sys.modules
                    or any(m.startswith("numba.cuda") for m in sys.modules)}

steps = {"import": {name: loaded(name) for name in KERNEL_FAMILIES}}
steps["cpu"], steps["cuda"] = {}, {}
for name, family in KERNEL_FAMILIES.items():
    family.cpu
    steps["cpu"][name] = loaded(name)
for name, family in KERNEL_FAMILIES.items():
    family.cuda
    steps["cuda"][name] = loaded(name)
print(json.dumps(steps))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])
    names = sorted(KERNEL_FAMILIES)
    assert steps["import"] == {n: {"numba": False, "compiled": False, "cuda": False}
                               for n in names}
    assert all(s["compiled"] and s["numba"] and not s["cuda"] for s in steps["cpu"].values())
    assert all(s["compiled"] and s["cuda"] for s in steps["cuda"].values())
