"""The compiled members of the fused optimiser, their launches, and the family's
:data:`IMPLEMENTATIONS`.

:class:`CpuPath` runs the CPU twins (:func:`refdml.gpu.optim._compiled.check_cpu`, then
:func:`~refdml.gpu.optim._compiled.commit_cpu`) and :class:`CudaPath` the CUDA kernels of
:mod:`refdml.gpu.optim._cuda` (three launches per step and dtype); both have the interface of
:class:`~refdml.gpu.optim._array.ArrayPath`. Each is built on first use: only then are
Numba (and ``numba.cuda``) imported.
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu.optim._array import ArrayPath

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath"]


class CpuPath:
    """The compiled CPU twins, NumPy arrays only (a serial loop over the flat buffers)."""

    def __init__(self) -> None:
        from refdml.gpu.optim import _compiled

        self.compiled = _compiled

    def first_nonfinite(self, backend: Backend, flat: Any, checks: Any, slot: int) -> None:
        self.compiled.first_nonfinite_cpu(flat, checks, slot)

    def step(self, backend: Backend, rule: int, hyper: dict[str, Any], values: Any, grads: Any,
             b1: Any, b2: Any, segment: Any, plan: Any, coef: Any, scalars: Any, status: Any,
             clock: Any, checks: Any) -> None:
        arguments = (rule, values, grads, b1, b2, segment, coef, scalars, status)
        self.compiled.prepare_cpu(plan, clock, coef, checks, status)
        self.compiled.check_cpu(*arguments)
        self.compiled.commit_cpu(*arguments, clock)


class CudaPath:
    """The CUDA kernels (three launches, no synchronisation); CuPy arrays on a GPU, NumPy
    arrays under Numba's simulator."""

    def __init__(self) -> None:
        from refdml.gpu.optim import _cuda

        self._first_nonfinite = _cuda.refdml_first_nonfinite
        self._check_block = _cuda.CHECK_BLOCK
        self._prepare = _cuda.refdml_optim_prepare
        self._check = _cuda.refdml_optim_check
        self._commit = _cuda.refdml_optim_commit

    def first_nonfinite(self, backend: Backend, flat: Any, checks: Any, slot: int) -> None:
        cuda_launch(self._first_nonfinite, 1, self._check_block, flat, checks, slot)

    def step(self, backend: Backend, rule: int, hyper: dict[str, Any], values: Any, grads: Any,
             b1: Any, b2: Any, segment: Any, plan: Any, coef: Any, scalars: Any, status: Any,
             clock: Any, checks: Any) -> None:
        n_blocks = max(1, -(-values.shape[0] // BLOCK))
        arguments = (rule, values, grads, b1, b2, segment, coef, scalars, status)
        cuda_launch(self._prepare, max(1, -(-plan.shape[0] // BLOCK)), BLOCK, plan, clock, coef,
                    checks, status)
        cuda_launch(self._check, n_blocks, BLOCK, *arguments)
        cuda_launch(self._commit, n_blocks, BLOCK, *arguments, clock)


#: The fused optimiser step, chosen once per step (:mod:`refdml.gpu.optim`).
IMPLEMENTATIONS: Implementations = Implementations(
    family="optim", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="cpu", auto_cupy="cuda",
    measured=("docs/benchmarks.md, 'The training step' (the CPU twin against the array "
              "path: python scripts/bench_train.py); on CuPy the kernels' three launches "
              "replace the array path's dozens (launch counts: tests/gpu/"
              "test_gpu_launch_counts.py); no GPU timing yet"))
