"""The PyTorch side of a conformance check: tensors in, ``torch.autograd.grad`` products out.

Imported only by :func:`refdml.conformance._frameworks.get_framework` when
``framework="torch"`` is asked for, so torch is not a dependency of refdml.

Arrays cross by DLPack (``torch.from_dlpack`` / ``numpy.from_dlpack``: no copy on the CPU),
with a copy where DLPack cannot carry them (a read-only NumPy array, a CUDA tensor going
back to NumPy). The inputs to differentiate are cloned into fresh leaves with
``requires_grad``, so the implementation never writes into the reference's arrays through
them and every run starts a new graph.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from refdml.conformance._autodiff import check_output_shapes, describe_type, host_values
from refdml.conformance._protocol import Evaluation, StructureError, flatten_outputs

__all__ = ["TorchFramework", "make_framework"]


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a NumPy array in its own dtype (bfloat16, which NumPy lacks, as float32)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    tensor = tensor.cpu().resolve_conj().resolve_neg()
    try:
        return np.from_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError):
        return tensor.numpy()


def _convert(part: Any) -> np.ndarray:
    """One output as NumPy for :func:`flatten_outputs`: a tensor or a real number.

    ``StructureError`` for a NumPy array or anything else: the graph is cut there, and
    autograd cannot see through it.
    """
    if isinstance(part, torch.Tensor):
        if part.is_complex():
            raise StructureError(f"an output is a complex tensor ({part.dtype}); the "
                                 "reference's outputs are real")
        return _to_numpy(part)
    if isinstance(part, numbers.Real) and not isinstance(part, (bool, np.bool_)):
        return np.asarray(part)
    raise StructureError(f"an output is a {describe_type(part)}; a torch implementation "
                         "returns torch.Tensor outputs (or real numbers), one or a tuple of them")


class TorchFramework:
    """:class:`refdml.conformance._frameworks.Framework` for PyTorch on ``device``."""

    name = "torch"
    pair = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"TorchFramework(device={str(self.device)!r})"

    def asarray(self, value: np.ndarray, dtype: str | None) -> torch.Tensor:
        """``value`` as a tensor on the device: floating arrays rounded to ``dtype``
        (float16, float32, float64 or bfloat16; None keeps theirs), integer and boolean
        arrays unchanged."""
        array, bfloat16 = host_values(value, dtype)
        try:
            tensor = torch.from_dlpack(array)
        except (BufferError, RuntimeError, TypeError):
            # Read-only, non-contiguous in a way DLPack refuses, or a dtype it cannot carry.
            tensor = torch.tensor(array)
        if bfloat16:  # exact: the values are bfloat16 numbers held as float32
            tensor = tensor.to(torch.bfloat16)
        return tensor.to(self.device)

    def run(
        self,
        call: Callable[[dict[str, Any]], Any],
        inputs: Mapping[str, Any],
        wrt: tuple[str, ...],
        cotangents: tuple[np.ndarray, ...] | None,
    ) -> Evaluation:
        """Run ``call(inputs)`` and, unless ``cotangents`` is None, ``torch.autograd.grad``
        of its outputs against ``cotangents`` with respect to ``wrt``.

        An input the outputs do not depend on gets None (``allow_unused``), as does every
        input when no output requires a gradient (all of them detached or numbers).
        ``StructureError`` where the outputs are not tensors or real numbers, or where their
        count or shapes differ from the cotangents' (the reference's outputs).
        """
        arguments = dict(inputs)
        leaves: dict[str, torch.Tensor] = {}
        if cotangents is not None:
            for name in wrt:
                value = arguments[name]
                if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                    raise TypeError(f"input {name!r} is differentiated, so it must be a "
                                    f"floating-point tensor, got {describe_type(value)}")
                leaves[name] = value.detach().clone().requires_grad_(True)
            arguments.update(leaves)
        returned = call(arguments)
        as_numpy = flatten_outputs(returned, _convert)
        outputs = tuple(returned) if isinstance(returned, (tuple, list)) else (returned,)
        if cotangents is None:
            return Evaluation(outputs=as_numpy, grads=None)
        check_output_shapes(as_numpy, cotangents)
        tracked = [(item, cotangent) for item, cotangent in zip(outputs, cotangents)
                   if isinstance(item, torch.Tensor) and item.requires_grad]
        if not tracked or not wrt:
            return Evaluation(outputs=as_numpy, grads={name: None for name in wrt})
        products = torch.autograd.grad(
            [item for item, _ in tracked],
            [leaves[name] for name in wrt],
            grad_outputs=[
                torch.as_tensor(np.asarray(cotangent), dtype=item.dtype, device=item.device)
                for item, cotangent in tracked
            ],
            allow_unused=True,
        )
        grads = {name: None if product is None else _to_numpy(product)
                 for name, product in zip(wrt, products)}
        return Evaluation(outputs=as_numpy, grads=grads)


def make_framework(*, device: str | None = None) -> TorchFramework:
    """The PyTorch framework on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``; None:
    ``"cpu"``); :func:`refdml.conformance._frameworks.get_framework` has checked its form
    (:func:`~refdml.conformance._frameworks.check_device`); here: that torch sees it."""
    if device is None:
        return TorchFramework(torch.device("cpu"))
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device == {device!r} is not a torch device") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device == {device!r}, but torch sees no CUDA device")
    if parsed.type == "cuda" and parsed.index is not None:
        count = torch.cuda.device_count()
        if parsed.index >= count:
            raise ValueError(f"device == {device!r}, but torch sees {count} CUDA device(s) "
                             f"(cuda:0 .. cuda:{count - 1})")
    return TorchFramework(parsed)
