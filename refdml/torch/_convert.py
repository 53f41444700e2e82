"""Tensors to refdml's arrays and back, without copies where the dtype allows.

* A CPU tensor is handed to refdml as the NumPy array over its memory (``Tensor.numpy``),
  a CUDA tensor as the CuPy array over its memory (DLPack); refdml's results come back the
  same way (``torch.from_numpy``, ``torch.from_dlpack``). A float32 or float64 tensor
  therefore crosses without a copy either way.
* float16 and bfloat16 have no fast path (NumPy has no bfloat16, and refdml's kernels are
  float32/float64): such tensors are computed in float32 (one copy in) and the results
  rounded to the tensor's dtype (one copy out), as PyTorch's own reductions accumulate
  half precision in float32. The entropic OT operators compute every precision below
  float64 in float64 (:attr:`refdml._interop.BridgedOp.low_precision` says why).
* On a GPU the work runs on ``torch.cuda.current_stream()``: :func:`on_device` makes it
  CuPy's current stream (an external stream; refdml's Numba kernels launch on the stream
  their arrays were exported on, :mod:`refdml.gpu._support.launch`), so no event or host
  synchronisation is added between PyTorch's work and refdml's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["FLOATING", "on_device", "to_array", "to_tensor"]

#: The floating dtypes the ops take.
FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_LOW_PRECISION = {"float32": torch.float32, "float64": torch.float64}


def device_type(tensor: torch.Tensor) -> str:
    """The tensor's device type (a seam: the tests stand a CPU tensor in for a CUDA one)."""
    return tensor.device.type


def _cupy(name: str, tensor: torch.Tensor) -> Any:
    try:
        import cupy
    except ImportError:
        raise ValueError(
            f"{name} is on {tensor.device}, and refdml runs CUDA tensors through CuPy, which "
            "is not installed: pip install cupy-cuda12x (or the wheel of your CUDA), or pass "
            f"{name}.cpu()"
        ) from None
    return cupy


def to_array(tensor: torch.Tensor, name: str, low_precision: str = "float32") -> Any:
    """The NumPy (CPU) or CuPy (CUDA) array over ``tensor``'s memory, in its dtype.

    ``tensor`` may still carry ``requires_grad`` (a custom op's forward runs below autograd
    but gets the caller's tensors): it is detached first, a view. A floating
    tensor below float64 is first cast (a copy) to ``low_precision`` where it is not that
    dtype already: float16 and bfloat16 to float32, or anything to float64.
    """
    tensor = tensor.detach()
    if tensor.dtype in FLOATING[1:]:
        tensor = tensor.to(torch.promote_types(tensor.dtype, _LOW_PRECISION[low_precision]))
    kind = device_type(tensor)
    if kind == "cpu":
        return tensor.resolve_conj().resolve_neg().numpy()
    if kind == "cuda":
        return _cupy(name, tensor).from_dlpack(tensor)
    raise ValueError(f"{name} is on {tensor.device}; refdml's ops run on cpu and cuda tensors")


def to_tensor(value: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` (a NumPy or CuPy array, or a number) as a tensor of ``dtype`` on ``device``.

    An array in ``dtype`` on the right device is shared, not copied; a number (a loss) is
    a new 0-d tensor.
    """
    if isinstance(value, np.ndarray):
        if not value.flags.writeable or any(step < 0 for step in value.strides):
            value = np.array(value)  # from_numpy shares writable, positive-stride memory
        tensor = torch.from_numpy(value)
    elif hasattr(value, "__dlpack__") and not isinstance(value, (float, np.generic)):
        tensor = torch.from_dlpack(value)
    else:
        return torch.tensor(float(value), dtype=dtype, device=device)
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.device == device else tensor.to(device)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Run refdml on ``device``'s current PyTorch stream (a no-op on the CPU)."""
    if device.type != "cuda":
        yield
        return
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index or 0), cupy.cuda.ExternalStream(stream.cuda_stream):
        yield
