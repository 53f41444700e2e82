"""Input validation of every public function: the reference, the fast path, the training pairs.

Public functions validate once, with these helpers, and raise ``TypeError`` for a
wrong type and ``ValueError`` for a bad value, naming the parameter and the value.
Private kernels assume valid input.

The reference's checks (:func:`as_float_array`, :func:`as_label_array`,
:func:`check_upstream`) return float64 (int64) NumPy arrays. Their array-aware twins for
the fast path and the training pairs (:func:`as_fast_array`, :func:`fast_labels`,
:func:`check_fast_upstream`, :func:`as_inputs`, :func:`check_upstream_like`) use the same
wording but keep float32 and float64 (integers become float64) and keep the array on its
device (NumPy or CuPy). Type, rank and shape checks never touch the data. The
data-dependent checks (finiteness, zero rows, integer-valued float labels, values beyond
float32) read every element: on NumPy they always run; on CuPy each is a reduction plus
one device-to-host synchronisation, so they run only while the backend's
:attr:`~refdml._backend.Backend.data_checks` is true (the default). A training loop that
has already validated its data may turn them off with
:func:`refdml._backend.set_finite_checks` (public as ``refdml.gpu.set_finite_checks``).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from refdml._backend import Backend, as_input_array, get_backend

__all__ = [
    "as_fast_array",
    "as_float_array",
    "as_inputs",
    "as_label_array",
    "cast_checked",
    "check_choice",
    "check_context",
    "check_fast_upstream",
    "check_features_prototypes",
    "check_flag",
    "check_float_dtype",
    "check_nonzero_rows",
    "check_rng",
    "check_same_length",
    "check_scalar",
    "check_upstream",
    "check_upstream_like",
    "data_checks",
    "fast_labels",
    "result_dtype",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The tensors of other array libraries, by the top-level package of their type, and how to
# hand their data to refdml. Recognised by name, so that checking costs no import of them.
_FOREIGN_TENSORS = {
    "torch": ("a torch.Tensor", "{name}.detach().cpu().numpy()"),
    "jax": ("a jax.Array", "numpy.asarray({name}) outside jax.jit"),
    "jaxlib": ("a jax.Array", "numpy.asarray({name}) outside jax.jit"),
    "tensorflow": ("a tensorflow.Tensor", "{name}.numpy()"),
}


def _refuse_non_array(value: Any, name: str, wanted: str) -> None:
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be {wanted}, got {_describe(value)}")
    foreign = _FOREIGN_TENSORS.get(type(value).__module__.partition(".")[0])
    if foreign is not None:
        # NumPy would convert some of these (a CPU tensor without requires_grad) and fail on
        # others with the library's own message; either way no gradient flows back to the
        # framework, so the conversion is the caller's, done knowingly.
        what, how = foreign
        raise TypeError(
            f"{name} is {what}; refdml's operators take NumPy arrays (CuPy on the fast path) "
            f"and return NumPy arrays, without autograd: pass {how.format(name=name)}"
        )


def _check_real_dtype(array: Any, name: str) -> np.dtype:
    kind = np.dtype(array.dtype)
    if kind == bool or not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)):
        raise TypeError(f"{name} must be an array of real numbers, got dtype {kind}")
    return kind


def _check_rank(array: Any, name: str, ndim, min_ndim, allow_empty: bool) -> None:
    shape = tuple(array.shape)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if array.ndim not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {shape}"
            )
    if min_ndim is not None and array.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {shape}")
    if not allow_empty and array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {shape}")


def _check_finite(xp: Any, array: Any, name: str, *, scalar_form: bool = False) -> None:
    """``ValueError`` naming the first non-finite entry (a 0-d one as ``name == value``)."""
    if bool(xp.all(xp.isfinite(array))):
        return
    if scalar_form and array.ndim == 0:
        raise ValueError(f"{name} == {array.item()}, must be finite")
    bad = tuple(int(i) for i in xp.argwhere(~xp.isfinite(array))[0])
    raise ValueError(f"{name} must be finite, got {array[bad]} at index {bad}")


def _upstream_array(value: Any, name: str, shape: tuple[int, ...]) -> Any:
    """The type and shape checks of an upstream gradient (NumPy or CuPy, data untouched)."""
    if value is None:
        raise TypeError(f"{name} must be an array of shape {shape}, got None")
    _refuse_non_array(value, name, "an array of real numbers")
    array = as_input_array(value)
    _check_real_dtype(array, name)
    if tuple(array.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(array.shape)}, must be {tuple(shape)} (the shape of the "
            "forward's output; it is not broadcast)"
        )
    return array


def _label_checks(array: Any, name: str, xp: Any, *, read_data: bool, length: int | None) -> None:
    kind = np.dtype(array.dtype)
    if kind == bool or not np.issubdtype(kind, np.integer):
        # Integral floats beyond int64 (1e300) would not survive the cast: refused here.
        integral = np.issubdtype(kind, np.floating) and (
            not read_data
            or bool(xp.all(xp.isfinite(array)) & xp.all(array == xp.round(array))
                    & xp.all(xp.abs(array) < 2.0**63))
        )
        if not integral:
            raise TypeError(f"{name} must hold integer labels, got dtype {kind}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {tuple(array.shape)}")
    if length is not None and array.shape[0] != length:
        raise ValueError(
            f"{name} has length {array.shape[0]}, but {length} labels are needed "
            "(one per embedding)"
        )


def as_float_array(
    value: Any,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    allow_empty: bool = False,
    finite: bool = True,
    copy: bool = True,
) -> np.ndarray:
    """Return ``value`` as a float64 array, checking type, rank, size and finiteness.

    Integer and float inputs (including float32) are accepted and converted to float64;
    booleans, complex numbers, strings and objects raise ``TypeError``. With
    ``copy=False`` a float64 input is returned without a copy (for read-only use of
    large inputs); otherwise the result is always a new array.
    """
    _refuse_non_array(value, name, "an array of real numbers")
    array = np.asarray(value)
    _check_real_dtype(array, name)
    array = np.array(array, dtype=np.float64, copy=True if copy else None)
    _check_rank(array, name, ndim, min_ndim, allow_empty)
    if finite:
        _check_finite(np, array, name)
    return array


def as_label_array(value: Any, name: str, *, length: int | None = None) -> np.ndarray:
    """Return integer class labels as a 1-d int64 array (optionally of a given length)."""
    _refuse_non_array(value, name, "a 1-d array of integer labels")
    array = np.asarray(value)
    _label_checks(array, name, np, read_data=True, length=length)
    return array.astype(np.int64, copy=True)


def check_scalar(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
    one_sided: bool = False,
) -> float | int:
    """Check a real (or integer) scalar against an interval; return it as float (int).

    A value outside is ``"name == value, must be in [low, inf)"``; with ``one_sided`` the
    bounds are stated as inequalities, in the order low, high and (integers) int64:
    ``"name == 0, must be >= 1"``, ``"... must be at most 9223372036854775807 (int64)"``
    (the wording of the training layers' sizes).
    """
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        if isinstance(value, np.ndarray) and value.ndim == 0 and not integer:
            value = value.item()
        else:
            wanted = "an integer" if integer else "a real number"
            raise TypeError(f"{name} must be {wanted}, got {_describe(value)}")
    value = int(value) if integer else float(value)
    if not integer and not np.isfinite(value):
        raise ValueError(f"{name} == {value}, must be finite")
    if one_sided:
        return _check_inequalities(value, name, low, high, low_inclusive, high_inclusive, integer)
    # Integers are counts, sizes and indices for NumPy: beyond int64 they would overflow there.
    if integer and not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} == {value}, must fit in int64 (|{name}| < 2**63)")
    lo_ok = low is None or (value >= low if low_inclusive else value > low)
    hi_ok = high is None or (value <= high if high_inclusive else value < high)
    if not (lo_ok and hi_ok):
        left = "-inf" if low is None else f"{low:g}"
        right = "inf" if high is None else f"{high:g}"
        interval = (
            ("[" if low_inclusive and low is not None else "(")
            + f"{left}, {right}"
            + ("]" if high_inclusive and high is not None else ")")
        )
        raise ValueError(f"{name} == {value!r}, must be in {interval}")
    return value


def _check_inequalities(value, name, low, high, low_inclusive, high_inclusive, integer):
    def shown(bound):
        return f"{bound}" if integer else f"{bound:g}"

    if low is not None and not (value >= low if low_inclusive else value > low):
        relation = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} == {value!r}, must be {relation} {shown(low)}")
    if high is not None and not (value <= high if high_inclusive else value < high):
        relation = "<=" if high_inclusive else "<"
        raise ValueError(f"{name} == {value!r}, must be {relation} {shown(high)}")
    # Integers are counts, sizes and indices for NumPy: beyond int64 they would overflow there.
    if integer and value > 2**63 - 1:
        raise ValueError(f"{name} == {value}, must be at most {2**63 - 1} (int64)")
    if integer and value < -(2**63):
        raise ValueError(f"{name} == {value}, must be at least {-(2**63)} (int64)")
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Check that ``value`` is one of the allowed strings."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {_describe(value)}")
    if value not in choices:
        raise ValueError(f"{name} == {value!r}, must be one of {choices}")
    return value



def check_flag(value: Any, name: str) -> bool:
    """``value`` as a Python bool; ``TypeError`` unless it is ``True``/``False`` (NumPy's
    ``bool_`` included): ``1`` or ``"no"`` for a switch is a mistake, not a truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_describe(value)}")
    return bool(value)

def check_float_dtype(value: Any, name: str = "dtype") -> np.dtype:
    """``value`` (``np.float32``, ``"float64"``, ...) as the dtype float32 or float64.

    ``TypeError`` naming ``name`` for anything else, ``None`` included (NumPy would read
    it as float64: a parameter documented as float32 or float64 takes one of them).
    """
    wanted = f"{name} must be float32 or float64"
    if value is None:
        raise TypeError(f"{wanted}, got None")
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise TypeError(f"{wanted}, got {_describe(value)}") from None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{wanted}, got {dtype}")
    return dtype


def check_rng(rng: Any) -> np.random.Generator:
    """Turn ``None``, an int seed or a Generator into a Generator (never the global one)."""
    if rng is None or isinstance(rng, (numbers.Integral, np.random.SeedSequence)):
        if isinstance(rng, bool):
            raise TypeError(f"rng must be None, an int or a numpy Generator, got {rng!r}")
        if isinstance(rng, numbers.Integral) and rng < 0:
            raise ValueError(f"rng == {int(rng)}, must be a non-negative seed (or None, or a Generator)")
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise TypeError(f"rng must be None, an int or a numpy Generator, got {_describe(rng)}")


def check_same_length(a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    """Check that two arrays have the same leading dimension."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{a_name} has {a.shape[0]} rows but {b_name} has {b.shape[0]}; they must match"
        )


def check_features_prototypes(features, prototypes) -> tuple[np.ndarray, np.ndarray]:
    """Validate per-image local features (B, n, d) and prototypes (m, d) of the same d."""
    features = as_float_array(features, "features", ndim=3)
    prototypes = as_float_array(prototypes, "prototypes", ndim=2)
    if features.shape[2] != prototypes.shape[1]:
        raise ValueError(
            "features and prototypes must have the same last dimension, got "
            f"features.shape={features.shape}, prototypes.shape={prototypes.shape}"
        )
    return features, prototypes


def check_context(ctx: Any, name: str, cls: type | tuple[type, ...]) -> Any:
    """Check that a backward was handed the context its own forward returns.

    Raises ``TypeError`` naming the parameter, the expected and the given type: a
    context of another operator (or a tuple, or None) must not reach the arithmetic,
    where it would give an ``AttributeError`` or a plausible but wrong gradient.
    """
    if not isinstance(ctx, cls):
        wanted = (
            " or ".join(c.__name__ for c in cls) if isinstance(cls, tuple) else cls.__name__
        )
        raise TypeError(
            f"{name} must be the {wanted} returned by the matching forward, "
            f"got {type(ctx).__name__}"
        )
    return ctx


def check_upstream(
    value: Any, name: str, shape: tuple[int, ...], *, allow_none: bool = False
) -> np.ndarray | None:
    """Validate an upstream gradient: real, exactly ``shape`` (no broadcasting), finite.

    Returns a float64 array (a 0-d array for a scalar output). ``None`` is returned
    unchanged only when ``allow_none`` (the caller documents that it means zero).
    A scalar output (``shape == ()``) also accepts a Python or NumPy real number.
    """
    if value is None and allow_none:
        return None
    array = np.array(_upstream_array(value, name, shape), dtype=np.float64)
    _check_finite(np, array, name, scalar_form=True)
    return array


# --- The fast path and the training pairs: NumPy or CuPy, float32 or float64 -------------


def data_checks(ns: Backend) -> bool:
    """True where data-dependent checks run (always on NumPy; on CuPy while enabled):
    :attr:`refdml._backend.Backend.data_checks`."""
    return ns.data_checks


def result_dtype(*arrays: Any) -> np.dtype:
    """float32 when every floating input is float32, else float64 (integers count as float64)."""
    dtypes = [np.dtype(a.dtype) for a in arrays if hasattr(a, "dtype")]
    if dtypes and all(d == np.float32 for d in dtypes):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def cast_checked(array: Any, dtype: Any, name: str, ns: Backend) -> Any:
    """``array`` (NumPy or CuPy) as ``dtype`` on ``ns``; narrowing float64 to float32, a finite
    entry beyond float32's range is a ``ValueError`` naming ``name`` and the entry (a cast
    would make it inf, or warn). The check reads the data: on CuPy only while
    the data checks (one synchronisation), and only when narrowing.
    """
    xp = ns.xp
    dtype = np.dtype(dtype)
    if (dtype == np.float32 and np.dtype(array.dtype).itemsize > 4
            and np.issubdtype(array.dtype, np.floating) and data_checks(ns)):
        array = xp.asarray(array)
        limit = float(np.finfo(np.float32).max)
        beyond = xp.isfinite(array) & (xp.abs(array) > limit)
        if bool(xp.any(beyond)):
            bad = tuple(int(i) for i in xp.argwhere(beyond)[0])
            where = f"[{bad[0] if len(bad) == 1 else bad}]" if bad else ""
            raise ValueError(
                f"{name}{where} == {float(array[bad])!r} is beyond the float32 range "
                f"(|x| <= {limit!r}) of this float32 computation"
            )
    with np.errstate(over="ignore"):  # only inf, -inf and nan are left to overflow
        return xp.asarray(array, dtype=dtype)


def as_fast_array(
    value: Any,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    dtype: Any = None,
    ns: Backend | None = None,
) -> Any:
    """Return ``value`` as a float32/float64 array of its own module, checked like the reference.

    ``dtype`` forces a dtype (e.g. the common dtype of several inputs); by default float32
    stays float32 and everything else real becomes float64. Booleans, complex numbers,
    strings and objects raise ``TypeError``; wrong rank, empty and (see module docstring)
    non-finite input raise ``ValueError`` naming ``name``.
    """
    _refuse_non_array(value, name, "an array of real numbers")
    ns = ns if ns is not None else get_backend(value)
    array = as_input_array(value)
    kind = _check_real_dtype(array, name)
    if dtype is None:
        dtype = kind if kind in _FLOATS else np.dtype(np.float64)
    array = cast_checked(array, dtype, name, ns)
    _check_rank(array, name, ndim, min_ndim, allow_empty=False)
    if data_checks(ns):
        _check_finite(ns.xp, array, name)
    return array


def check_fast_upstream(value: Any, name: str, shape: tuple[int, ...], ns: Backend,
                        dtype: Any) -> Any:
    """An upstream gradient: real, exactly ``shape``, finite; returned in ``dtype`` on ``ns``.

    A scalar output (``shape == ()``) also accepts a Python or NumPy real number, returned
    as a Python float (no device array needed to scale by it).
    """
    if tuple(shape) == () and isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"{name} == {value}, must be finite")
        return value
    array = cast_checked(_upstream_array(value, name, shape), dtype, name, ns)
    if data_checks(ns):
        _check_finite(ns.xp, array, name, scalar_form=True)
    return array


def fast_labels(value: Any, name: str, ns: Backend, *, length: int | None = None) -> Any:
    """Integer class labels as a 1-d int64 array of ``ns`` (like :func:`as_label_array`)."""
    _refuse_non_array(value, name, "a 1-d array of integer labels")
    array = as_input_array(value)
    _label_checks(array, name, ns.xp, read_data=data_checks(ns), length=length)
    return ns.xp.asarray(array, dtype=ns.xp.int64)


def check_nonzero_rows(xp: Any, x: Any, name: str, *, why: str, ns: Backend) -> None:
    """``ValueError`` naming ``name`` and the first all-zero row (last axis)."""
    if not data_checks(ns):
        return
    zero = ~xp.any(x != 0, axis=-1)
    if bool(xp.any(zero)):
        index = tuple(int(i) for i in xp.argwhere(zero)[0])
        where = index[0] if len(index) == 1 else index
        raise ValueError(f"{name} has a zero vector at row {where}; {why}")


def as_inputs(
    spec: dict[str, tuple[Any, int | tuple[int, ...] | None]],
) -> tuple[Backend, np.dtype, dict[str, Any]]:
    """Check named inputs ``{name: (value, ndim)}``; return namespace, common dtype, arrays.

    The training pairs' entry check: the inputs keep their array module, and their dtype is
    float32 only when all are float32.
    """
    for name, (value, _) in spec.items():
        _refuse_non_array(value, name, "an array of real numbers")
    values = [v for v, _ in spec.values()]
    ns = get_backend(*values)
    dtype = result_dtype(*[v for v in values if hasattr(v, "dtype")])
    arrays = {
        name: as_fast_array(value, name, ndim=ndim, dtype=dtype, ns=ns)
        for name, (value, ndim) in spec.items()
    }
    return ns, dtype, arrays


def check_upstream_like(d_y: Any, name: str, shape: tuple[int, ...], like: Any) -> Any:
    """``d_y`` real, finite, exactly ``shape``; returned in the dtype and module of ``like``.

    ``like`` is any array of the context (it tells the device and the dtype).
    """
    ns = get_backend(like)
    return check_fast_upstream(d_y, name, tuple(shape), ns, like.dtype)
