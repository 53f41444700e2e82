"""The kernel families of the fast path: the one place a family is registered.

A kernel family is a package ``refdml/gpu/<family>/`` (named as the reference names the
family) with compiled kernels beside its array path, and one
:class:`~refdml.gpu._support.modes.Implementations` object that holds them and chooses among
them. :data:`KERNEL_FAMILIES` lists those objects, and nothing else lists families: the catalogue
derives each operator's kernel variants from its family's object (``kernel_family``, then
:attr:`~refdml.gpu._support.modes.Implementations.kernel_modes`), the parity suite and the
launch ceilings follow the catalogue, and the compile check compiles the CUDA kernels of the
registered families (:meth:`KernelFamilies.cuda_kernels`). A new family is one line here
(tests/gpu/test_families.py registers a synthetic one and watches all of them see it).

Importing this module imports every family but loads no CUDA code: a family's CUDA member
(and ``numba.cuda``) loads on its first use, or in :meth:`KernelFamilies.cuda_kernels`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from refdml.gpu import gsp, kcenter, linalg, losses, metrics, normalize, optim, ot
from refdml.gpu._support.modes import Implementations

if TYPE_CHECKING:       # importing it imports numba.cuda: cuda_kernels() does, when asked
    from refdml.gpu._support.cuda import CudaKernel

__all__ = ["KERNEL_FAMILIES", "KernelFamilies"]


class KernelFamilies(Mapping[str, Implementations]):
    """The registered kernel families by name (a read-only mapping; :meth:`registered`
    adds one for a block, for tests)."""

    def __init__(self, families: tuple[Implementations, ...]) -> None:
        self._families: dict[str, Implementations] = {}
        for family in families:
            self._add(family)

    def _add(self, family: Implementations) -> None:
        if not isinstance(family, Implementations):
            raise TypeError(f"a kernel family is an Implementations object, got "
                            f"{type(family).__name__}")
        if family.family in self._families:
            raise ValueError(f"kernel family {family.family!r} is registered twice")
        self._families[family.family] = family

    def __getitem__(self, name: str) -> Implementations:
        return self._families[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)

    def __repr__(self) -> str:
        return f"KernelFamilies({list(self._families)})"

    @contextlib.contextmanager
    def registered(self, family: Implementations) -> Iterator[Implementations]:
        """``family`` registered for the block, removed after (tests)."""
        self._add(family)
        try:
            yield family
        finally:
            del self._families[family.family]

    def cuda_kernels(self) -> dict[str, CudaKernel]:
        """Every CUDA kernel of the registered families, by name: each family's CUDA member
        is loaded (its module declares its kernels, :func:`~refdml.gpu._support.cuda.cuda_kernel`),
        then the declared kernels of these families are returned in declaration order.
        Imports ``numba.cuda``."""
        from refdml.gpu._support.cuda import KERNELS

        for family in self._families.values():
            family.cuda                        # loads the module that declares its kernels
        return {name: kernel for name, kernel in KERNELS.items()
                if kernel.family in self._families}


#: The kernel families of refdml.gpu.
KERNEL_FAMILIES = KernelFamilies((gsp.IMPLEMENTATIONS, kcenter.IMPLEMENTATIONS,
                                 linalg.IMPLEMENTATIONS, losses.IMPLEMENTATIONS,
                                 metrics.IMPLEMENTATIONS,
                                 normalize.IMPLEMENTATIONS, optim.IMPLEMENTATIONS,
                                 ot.IMPLEMENTATIONS))
