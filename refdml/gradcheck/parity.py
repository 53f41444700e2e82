"""Parity of a fast-path mirror with the float64 reference, for one operator description.

:func:`check_parity` is the one comparison rule of the GPU parity suite
(``tests/gpu/test_gpu_parity.py``) and of ``refdml gpu-check``. It knows no operator: it takes
any object with the attributes of :class:`MirroredOperator` (in practice an entry of
:mod:`refdml.catalog`, the layer above, which hands it here), so the harness never
imports the catalogue.

1. ``inputs = spec.make_inputs(rng)`` with ``rng = numpy.random.default_rng(seed)``; the
   reference ``spec.forward(**inputs)`` and ``spec.backward(ctx, *upstream)`` run in
   float64 on NumPy, with one standard-normal upstream gradient per output drawn from
   the same ``rng`` after the inputs.
2. The mirror (``spec.mirror_pair()``) gets the same keywords with every floating array
   cast to ``dtype`` and moved to the backend (NumPy, or CuPy on the current device),
   integer arrays moved unchanged, everything else passed as is; its backward gets the
   same upstream gradients cast likewise (a scalar upstream stays a Python float).
3. Each output and each gradient is compared with the reference by

   .. math::
       \\mathrm{err} = \\frac{\\max_i |a_i - e_i|}{\\max_i |e_i|}

   (relative to the largest magnitude of the reference, so entries near zero are held
   to the precision of the whole array, which is what float32 can promise); the entry
   passes when every ``err <= spec.mirror_tolerance(dtype)``, every shape matches,
   every array output has the input dtype, and the mirror returns a gradient for every
   input the reference differentiates.

Kernels: ``kernels`` picks what the mirror runs (:func:`refdml.gpu.use_kernels`): the
array path (``"array"``), or one of the compiled Numba kernels the entry lists in
``spec.mirror_kernels`` (``"cpu"``, ``"cuda"``; ``"cuda"`` on the NumPy backend runs under
Numba's CUDA simulator). The same rule and tolerances hold for every kernel.

Timing: ``seconds`` is the median wall time of the mirror's forward + backward over
``timing_repeats`` runs after the checked one (so a CuPy kernel's first-call compilation
is not counted), each ended by a device synchronisation on CuPy; with
``timing_repeats=0`` it is the time of the checked run itself. Inputs are catalogue-sized
(small): the time says whether the mirror runs, not how fast it is at scale (see
``scripts/bench_gpu.py`` for that).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from refdml._backend import Backend, get_backend, to_numpy
from refdml._validation import _describe, check_choice, check_scalar
from refdml.gpu import cupy_available, use_kernels

__all__ = [
    "BACKENDS",
    "DTYPES",
    "KERNEL_CHOICES",
    "MirroredOperator",
    "ParityResult",
    "available_backends",
    "check_parity",
    "kernel_cases",
]

BACKENDS = ("numpy", "cupy")
DTYPES = ("float64", "float32")
KERNEL_CHOICES = ("array", "cpu", "cuda")
"""The modes ``check_parity(kernels=...)`` accepts, named as :func:`refdml.gpu.use_kernels`
names them: the array path, the compiled CPU twin, the CUDA kernel. Modes, not kernels: an
entry lists the compiled ones it has in ``spec.mirror_kernels``."""


class MirroredOperator(Protocol):
    """What :func:`check_parity` reads of an operator (:class:`refdml.catalog.OperatorSpec`).

    ``forward(**inputs) -> (outputs, ctx)`` and ``backward(ctx, *upstream) -> grads`` are
    the float64 reference; ``make_inputs(rng)`` the keyword arguments of both forwards;
    ``mirror_pair()`` the fast path's ``(forward, backward)`` or None (``no_mirror`` says
    why); ``mirror_tolerance(dtype_name)`` the relative tolerance; ``mirror_kernels`` the
    compiled kernels the mirror has beside its array path.
    """

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    make_inputs: Callable[[np.random.Generator], Mapping[str, Any]]
    mirror_kernels: tuple[str, ...]
    no_mirror: str | None

    def mirror_pair(self) -> tuple[Callable[..., Any], Callable[..., Any]] | None: ...

    def mirror_tolerance(self, dtype_name: str) -> float: ...


_REQUIRED = ("name", "forward", "backward", "make_inputs", "mirror_kernels", "no_mirror",
             "mirror_pair", "mirror_tolerance")


@dataclass(frozen=True)
class ParityResult:
    """One operator's mirror on one backend and dtype, against the reference.

    name : the operator's name (``"losses.contrastive"``).
    backend, dtype : ``"numpy"`` or ``"cupy"``; ``"float64"`` or ``"float32"``.
    output_error, gradient_error : largest relative error (see the module docstring) over
        the outputs, over the gradients (``inf`` where a shape differs or one is missing).
    tolerance : ``spec.mirror_tolerance(dtype)``.
    passed : every error within tolerance and no problem below.
    seconds : the mirror's forward + backward time (see the module docstring).
    problems : what failed, one sentence each (empty when passed).
    """

    name: str
    backend: str
    dtype: str
    output_error: float
    gradient_error: float
    tolerance: float
    passed: bool
    seconds: float
    problems: tuple[str, ...] = ()
    kernels: str = "array"


def available_backends() -> tuple[str, ...]:
    """``("numpy",)``, plus ``"cupy"`` where CuPy sees a CUDA device."""
    return ("numpy", "cupy") if cupy_available() else ("numpy",)


def _backend_named(backend: str) -> Backend:
    """The backend named ``backend`` (the user's choice, checked by the caller)."""
    if backend == "numpy":
        return get_backend()
    if not cupy_available():
        raise RuntimeError("backend == 'cupy' needs CuPy and a CUDA device; none here")
    import cupy

    return get_backend(cupy.empty(0))


def _cast(value: Any, xp: Any, dtype: np.dtype) -> Any:
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        return xp.asarray(value.astype(dtype))
    if isinstance(value, np.ndarray):
        return xp.asarray(value)
    return value


def _fields(grads: Any) -> dict:
    if isinstance(grads, dict):
        return dict(grads)
    return {f.name: getattr(grads, f.name) for f in dataclasses.fields(grads)}


def _as_tuple(outputs: Any) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _relative_error(actual: Any, expected: Any) -> tuple[float, str | None]:
    """``max|a - e| / max|e|`` and a problem (shape mismatch) or None."""
    actual = to_numpy(actual).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return float("inf"), f"shape {actual.shape} != {expected.shape}"
    scale = max(float(np.max(np.abs(expected), initial=0.0)), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(actual - expected), initial=0.0)) / scale, None


def check_parity(
    spec: MirroredOperator, *, backend: str = "numpy", dtype: str = "float64", seed: int = 0,
    timing_repeats: int = 1, kernels: str = "array",
) -> ParityResult:
    """Compare the mirror of ``spec`` with the reference (module docstring).

    Parameters
    ----------
    spec : MirroredOperator
        An operator description with a mirror, e.g.
        ``refdml.catalog.get("normalize.l2_normalize")``.
    backend : {"numpy", "cupy"}
        ``"cupy"`` raises ``RuntimeError`` where CuPy has no CUDA device.
    dtype : {"float64", "float32"}
    seed : int >= 0
        Seeds the inputs and the upstream gradients.
    timing_repeats : int >= 0
        Extra runs timed after the checked one (median); 0 times the checked run.
    kernels : {"array", "cpu", "cuda"}
        The array path, or a compiled kernel listed in ``spec.mirror_kernels``.

    Returns
    -------
    ParityResult
        Exceptions raised by the mirror or the reference propagate (a crash is not a
        parity failure to be tabulated here; ``refdml gpu-check`` reports it as CRASH).
    """
    missing = [attribute for attribute in _REQUIRED if not hasattr(spec, attribute)]
    if missing:
        raise TypeError(f"spec must be an operator description (refdml.catalog.OperatorSpec), "
                        f"got {_describe(spec)} without {', '.join(missing)}")
    backend = check_choice(backend, "backend", BACKENDS)
    dtype_name = check_choice(dtype, "dtype", DTYPES)
    seed = check_scalar(seed, "seed", low=0, integer=True)
    timing_repeats = check_scalar(timing_repeats, "timing_repeats", low=0, integer=True)
    kernels = check_choice(kernels, "kernels", KERNEL_CHOICES)
    pair = spec.mirror_pair()
    if pair is None:
        raise ValueError(f"{spec.name} has no mirror ({spec.no_mirror or 'and no reason given'})")
    if kernels != "array" and kernels not in spec.mirror_kernels:
        raise ValueError(f"kernels == {kernels!r}, but {spec.name} has only the array path"
                         + "".join(f" and a {k!r} kernel" for k in spec.mirror_kernels))
    ns = _backend_named(backend)
    xp = ns.xp
    forward, backward = pair

    rng = np.random.default_rng(seed)
    inputs = dict(spec.make_inputs(rng))
    ref_out, ref_ctx = spec.forward(**inputs)
    ref_out = _as_tuple(ref_out)
    upstream = [rng.standard_normal(np.shape(o)) for o in ref_out]
    ref_grads = _fields(spec.backward(ref_ctx, *upstream))

    np_dtype = np.dtype(dtype_name)
    fast_inputs = {k: _cast(v, xp, np_dtype) for k, v in inputs.items()}
    fast_upstream = [xp.asarray(g.astype(np_dtype)) if np.ndim(g) else float(g) for g in upstream]

    def run():
        with use_kernels(kernels):
            out, ctx = forward(**fast_inputs)
            return out, backward(ctx, *fast_upstream)

    ns.synchronize()
    start = time.perf_counter()
    out, grads = run()
    ns.synchronize()
    seconds = time.perf_counter() - start
    out, grads = _as_tuple(out), _fields(grads)

    tolerance = spec.mirror_tolerance(dtype_name)
    problems: list[str] = []
    output_error = 0.0
    if len(out) != len(ref_out):
        problems.append(f"the mirror returns {len(out)} outputs, the reference {len(ref_out)}")
        output_error = float("inf")
    for k, (a, e) in enumerate(zip(out, ref_out)):
        if hasattr(a, "dtype") and np.ndim(e) > 0 and np.dtype(a.dtype) != np_dtype:
            problems.append(f"output {k} has dtype {a.dtype}, not {np_dtype}")
        err, problem = _relative_error(a, e)
        if problem:
            problems.append(f"output {k}: {problem}")
        elif err > tolerance:
            problems.append(f"output {k}: max relative error {err:.2e} > {tolerance:.0e}")
        output_error = max(output_error, err)
    gradient_error = 0.0
    for name, expected in ref_grads.items():
        if name not in grads:
            problems.append(f"the mirror returns no gradient for {name}")
            gradient_error = float("inf")
            continue
        err, problem = _relative_error(grads[name], expected)
        if problem:
            problems.append(f"gradient {name}: {problem}")
        elif err > tolerance:
            problems.append(f"gradient {name}: max relative error {err:.2e} > {tolerance:.0e}")
        gradient_error = max(gradient_error, err)

    if timing_repeats:
        times = []
        for _ in range(timing_repeats):
            ns.synchronize()
            start = time.perf_counter()
            run()
            ns.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
    return ParityResult(
        name=spec.name, backend=backend, dtype=dtype_name, output_error=output_error,
        gradient_error=gradient_error, tolerance=tolerance, passed=not problems,
        seconds=seconds, problems=tuple(problems), kernels=kernels,
    )


def kernel_cases(specs) -> list[tuple[Any, str]]:
    """``(spec, kernels)`` for every compiled kernel of every mirrored entry of ``specs``
    (``spec.mirror_kernels``, in order): the rows the parity suite and ``refdml gpu-check``
    run beside each mirror's array path."""
    return [(spec, kernels) for spec in specs if spec.mirror is not None
            for kernels in spec.mirror_kernels]
