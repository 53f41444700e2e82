"""The CuPy side of a conformance check: an implementation in refdml's pair protocol on
CuPy arrays.

Imported only by :func:`refdml.conformance._frameworks.get_framework` when
``framework="cupy"`` is asked for, so CuPy is not a dependency of refdml.

The implementation is a pair, as for ``"numpy"``: ``forward(**inputs) -> (outputs, ctx)``
on CuPy arrays, and the user's ``backward(ctx, *cotangents) -> grads`` (a mapping, or an
object with one attribute per differentiated input), given one CuPy cotangent per output
in that output's dtype (a 0-d array for a scalar output). There is no autodiff: the
products are the backward's.

Crossing between host and device. The reference's arrays are NumPy arrays in host memory
and CuPy's live in device memory, so no protocol can share one buffer between them:
DLPack carries a pointer without a copy only on one device, and NumPy-to-CuPy is a
host-to-device copy whichever way it is spelled. This module makes the two copies
explicit, ``cupy.asarray`` for the inputs and cotangents (host to device) and
``cupy.asnumpy`` for the outputs and gradients (device to host); they are inputs and
results of a check, a few kilobytes, never inside the implementation's own computation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import cupy
import numpy as np

from refdml._validation import check_float_dtype
from refdml.conformance._protocol import Evaluation, run_pair

__all__ = ["CupyFramework", "make_framework"]

_DEVICE = re.compile(r"(?:cuda|gpu)(?::(\d+))?")


def _to_host(value: Any) -> np.ndarray:
    """A CuPy array, a NumPy array or a number as a NumPy array (a device-to-host copy for
    CuPy's: ``numpy.asarray`` refuses a CuPy array)."""
    if isinstance(value, cupy.ndarray):
        return cupy.asnumpy(value)
    return np.asarray(value)


class CupyFramework:
    """:class:`refdml.conformance._frameworks.Framework` for CuPy pairs on one device."""

    name = "cupy"
    pair = True

    def __init__(self, backward: Callable[..., Any], device_id: int) -> None:
        self.backward = backward
        self.device_id = device_id

    def __repr__(self) -> str:
        return f"CupyFramework(device_id={self.device_id})"

    def asarray(self, value: np.ndarray, dtype: str | None) -> Any:
        """``value`` copied to the device: floating arrays cast to ``dtype`` (None:
        float64), integer and boolean arrays in their own dtype."""
        host = np.asarray(value)
        if host.dtype.kind == "f":
            host = host.astype(check_float_dtype(dtype) if dtype is not None else np.float64,
                               copy=False)
        with cupy.cuda.Device(self.device_id):
            return cupy.asarray(host)

    def run(
        self,
        call: Callable[[dict[str, Any]], Any],
        inputs: Mapping[str, Any],
        wrt: tuple[str, ...],
        cotangents: tuple[np.ndarray, ...] | None,
    ) -> Evaluation:
        """Run the pair's forward (``call(inputs)``) and, unless ``cotangents`` is None, its
        backward with the cotangents copied to the device, each in its output's dtype.

        ``StructureError`` (:mod:`refdml.conformance._protocol`) where the forward does not
        return a pair ``(outputs, ctx)`` or an output is not a real array or number.
        """
        with cupy.cuda.Device(self.device_id):
            return run_pair(call, inputs, wrt, cotangents, self.backward, label="CuPy",
                            to_host=_to_host, to_device=cupy.asarray)


def make_framework(*, backward: Callable[..., Any], device: str | None = None) -> CupyFramework:
    """The CuPy framework with the pair's ``backward`` on ``device``.

    ``device`` is None (CuPy's current device), ``"cuda"`` (the same) or ``"cuda:N"``
    (device ``N``); :func:`refdml.conformance._frameworks.get_framework` has checked its
    type and ``backward``'s.
    """
    if device is None:
        return CupyFramework(backward, cupy.cuda.Device().id)
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise ValueError(f"device == {device!r}, must be None, 'cuda' or 'cuda:N' for "
                         "framework 'cupy' (CuPy arrays live on a GPU; 'numpy' checks a "
                         "pair on the CPU)")
    if match.group(1) is None:
        return CupyFramework(backward, cupy.cuda.Device().id)
    device_id = int(match.group(1))
    count = cupy.cuda.runtime.getDeviceCount()
    if device_id >= count:
        raise ValueError(f"device == {device!r}, but CuPy sees {count} device(s) "
                         f"(cuda:0 .. cuda:{count - 1})")
    return CupyFramework(backward, device_id)
