"""The JAX side of a conformance check: JAX arrays in, ``jax.vjp`` products out.

Imported only by :func:`refdml.conformance._frameworks.get_framework` when
``framework="jax"`` is asked for, so JAX is not a dependency of refdml.

float64 needs JAX's x64 mode, which is off by default (every float64 array is then
silently float32). This module never flips the global switch: :meth:`JaxFramework.asarray`
makes float64 arrays and :meth:`JaxFramework.run` evaluates the implementation inside
``jax.enable_x64(True)`` when a floating input is float64, and leaves the mode as the user
set it otherwise (a float32 check then runs exactly as the user's code would).

Arrays cross by DLPack (``jax.dlpack.from_dlpack`` / ``numpy.from_dlpack``), with a copy
where DLPack cannot carry them (a read-only or non-contiguous NumPy array).
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdml.conformance._autodiff import check_output_shapes, describe_type, host_values
from refdml.conformance._protocol import Evaluation, StructureError, flatten_outputs

__all__ = ["JaxFramework", "make_framework"]


def _to_numpy(array: Any) -> np.ndarray:
    """A JAX array as NumPy, in its own dtype (bfloat16 as float32: NumPy has none)."""
    if array.dtype == jnp.bfloat16:
        array = array.astype(jnp.float32)
    try:
        return np.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError):
        return np.asarray(array)


def _parts(outputs: Any) -> tuple[Any, ...]:
    """The outputs as a tuple, split as :func:`flatten_outputs` splits them; each part a
    real array (JAX's, traced or not, or NumPy's) or a real number, else ``StructureError``
    (checked on the traced values, which cannot be converted to NumPy inside ``jax.vjp``).
    """
    parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    for k, part in enumerate(parts):
        if isinstance(part, (jax.Array, np.ndarray, np.generic)):
            if not (jnp.issubdtype(part.dtype, jnp.floating)
                    or jnp.issubdtype(part.dtype, jnp.integer)):
                raise StructureError(f"output {k} has dtype {part.dtype}; outputs must be "
                                     "real arrays or numbers")
        elif isinstance(part, bool) or not isinstance(part, numbers.Real):
            raise StructureError(
                f"output {k} is a {describe_type(part)}; a JAX implementation returns "
                "jax.Array outputs (or real numbers), one or a tuple of them"
            )
    return parts


def _as_numpy(parts: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    return flatten_outputs(parts, lambda part: _to_numpy(jnp.asarray(part)))


def _is_float64(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray)) and value.dtype == np.float64


def _zero_cotangent(output: Any) -> Any:
    """JAX's cotangent of an integer output: ``float0`` zeros."""
    return np.zeros(np.shape(output), dtype=jax.dtypes.float0)


class JaxFramework:
    """:class:`refdml.conformance._frameworks.Framework` for JAX on ``device``."""

    name = "jax"
    pair = False

    def __init__(self, device: Any) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"JaxFramework(device={self.device!r})"

    def asarray(self, value: np.ndarray, dtype: str | None) -> jax.Array:
        """``value`` as a JAX array on the device: floating arrays rounded to ``dtype``
        (float16, float32, float64, the last made inside ``jax.enable_x64(True)``, or
        bfloat16; None keeps theirs), integer and boolean arrays with their values (int64
        as JAX's int32 unless x64 is on: labels and indices fit)."""
        array, bfloat16 = host_values(value, dtype)
        with _precision(array.dtype == np.float64):
            try:
                out = jax.dlpack.from_dlpack(array)
            except (BufferError, RuntimeError, TypeError, ValueError):
                out = jnp.array(array)
            if bfloat16:  # exact: the values are bfloat16 numbers held as float32
                out = out.astype(jnp.bfloat16)
            return jax.device_put(out, self.device)

    def run(
        self,
        call: Callable[[dict[str, Any]], Any],
        inputs: Mapping[str, Any],
        wrt: tuple[str, ...],
        cotangents: tuple[np.ndarray, ...] | None,
    ) -> Evaluation:
        """Run ``call(inputs)`` and, unless ``cotangents`` is None, ``jax.vjp`` of its
        outputs with respect to the inputs named in ``wrt`` (the others closed over).

        Runs inside ``jax.enable_x64(True)`` when a floating input is float64. JAX reports
        no "unused" input: one the outputs do not depend on gets zeros, never None.
        ``StructureError`` where the outputs are not arrays or real numbers, or where their
        count or shapes differ from the cotangents' (the reference's outputs).
        """
        with _precision(any(_is_float64(value) for value in inputs.values())):
            if cotangents is None:
                return Evaluation(outputs=_as_numpy(_parts(call(dict(inputs)))), grads=None)
            for name in wrt:
                value = inputs[name]
                if not (isinstance(value, jax.Array)
                        and jnp.issubdtype(value.dtype, jnp.floating)):
                    raise TypeError(f"input {name!r} is differentiated, so it must be a "
                                    f"floating-point jax.Array, got {describe_type(value)}")

            def function(*differentiated):
                arguments = dict(inputs)
                arguments.update(zip(wrt, differentiated))
                return tuple(jnp.asarray(part) for part in _parts(call(arguments)))

            outputs, vjp = jax.vjp(function, *(inputs[name] for name in wrt))
            as_numpy = _as_numpy(outputs)
            check_output_shapes(as_numpy, cotangents)
            products = vjp(tuple(
                jnp.asarray(np.asarray(cotangent), dtype=item.dtype)
                if jnp.issubdtype(item.dtype, jnp.inexact) else _zero_cotangent(item)
                for item, cotangent in zip(outputs, cotangents)
            ))
            grads = {name: _to_numpy(product) for name, product in zip(wrt, products)}
        return Evaluation(outputs=as_numpy, grads=grads)


def _precision(float64: bool):
    """``jax.enable_x64(True)`` for a float64 evaluation; otherwise the user's own mode."""
    return jax.enable_x64(True) if float64 else contextlib.nullcontext()


def make_framework(*, device: str | None = None) -> JaxFramework:
    """The JAX framework on ``device`` (a platform such as ``"cpu"`` or ``"gpu"``, ``"cuda"``
    meaning ``"gpu"``; None: JAX's default device);
    :func:`refdml.conformance._frameworks.get_framework` has checked its type."""
    if device is None:
        return JaxFramework(jax.devices()[0])
    if not device:   # jax.devices("") is the default backend's: an empty name would pass
        raise ValueError("device == '', must be None or a platform such as 'cpu' or 'gpu'")
    platform = "gpu" if device == "cuda" else device
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        raise ValueError(f"device == {device!r}, but JAX has no such device (it has "
                         f"{sorted({d.platform for d in jax.devices()})})") from None
    return JaxFramework(devices[0])
