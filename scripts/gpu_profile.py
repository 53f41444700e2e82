"""Where the time of a GPU call goes: for each workload, the wall time of one call, the
device time of every kernel it runs, its kernel launches and its host synchronisations
(docs/gpu/cost-model.md, "Profiling a GPU run"). A profiler, not a benchmark: scripts/bench_gpu.py
times paths against each other; this says what one call is made of.

    python scripts/gpu_profile.py --json gpu_profile.json             # on a GPU machine
    python scripts/gpu_profile.py --dry-run --json gpu_profile.json   # anywhere (CI)
    python scripts/gpu_profile.py --only gsp --only kcenter           # some workloads
    python scripts/gpu_profile.py --kernels auto array                # each in both modes

Workloads (float32, on CuPy arrays; ``--dry-run``: tiny sizes on the CuPy stand-in):

``gsp``        GSP pooling forward + backward (refdml.gpu.gsp), B = 256, m = 64, n = 49,
               d = 128, mu = 0.3, inverse temperature 5
``train``      one digits-collage training step (scripts/bench_gpu.py's ``_TrainStep``),
               batch 64
``retrieval``  retrieval metrics (refdml.gpu.metrics), 10,000 queries x 200,000 x 128
``kcenter``    greedy k-center (refdml.gpu.kcenter), 200,000 x 128, k = 200
``sinkhorn``   all-pairs Sinkhorn divergence (refdml.gpu.ot), 256 clouds of 49 points in
               R^128, eps 0.05 (32,896 OT problems)

``--kernels MODE ...`` runs each workload under ``refdml.gpu.use_kernels(MODE)`` for each
mode given (default ``auto``: each family's measured-fastest path on CuPy, which is the
CUDA kernels except for retrieval, whose array path measured faster). The dry run's
training step takes the array path whatever the mode, as bench_gpu.py's does: a step of
simulated kernels takes longer than all the rest of the dry run, and the other workloads
run those kernels already.

How a workload is measured. Its first call (compilation, caches) is timed apart; then
``--repeats`` calls (or fewer, once they have taken ``--max-seconds``), each between two
device synchronisations and with no profiler attached, give the wall time (median). Then
one more call runs under every recorder this machine has, each named in the row:

- **refdml's launch recorder** (always; ``REFDML_CUDA_PROFILE=1``, which this script sets
  unless the environment says ``0``): :func:`refdml.gpu._support.profile.launch_profile`.
  Every refdml kernel passes through ``cuda_launch``, which counts the launches per kernel
  name and, on a GPU, brackets each with two CUDA events on its stream (read after the call,
  with one synchronisation outside it). Sees refdml's Numba kernels only; an event span
  also holds Numba's host launch time where the stream was idle (an upper bound). Under the
  simulator: counts only.
- **torch's profiler, CUPTI underneath** (on a GPU with torch; ``--no-torch`` leaves it
  out): ``torch.profiler.profile(activities=[CPU, CUDA])`` traces every kernel of the
  process, whoever launched it (refdml's Numba kernels, CuPy's, cuBLAS's), with its device
  time, and the CUDA runtime API calls (``cudaLaunchKernel``, ``cudaMemcpy``,
  ``cudaStreamSynchronize``, ...) and driver launches (``cuLaunchKernel``, Numba's and
  CuPy's launch call). CUPTI's synchronisation records (``enable_cuda_sync_events`` of
  torch's experimental config) add the driver-level waits that no runtime call shows
  (Numba's ``cuCtxSynchronize``). The call runs inside a ``record_function`` range; API
  calls and synchronisations count only inside it (the profiler's own synchronisation at
  exit falls outside), device work from its start on. The trace is read from
  ``export_chrome_trace``'s JSON by event category (``kernel``, ``gpu_memcpy``,
  ``cuda_runtime``, ``cuda_driver``, ``cuda_sync``), so a category this torch does not
  emit leaves its column empty with a note, never a wrong zero.
- **the CuPy stand-in's transfer counter** (dry run): ``count_transfers()`` of
  tests/cupy_standin counts every device-to-host read and synchronisation CuPy would make
  (``float()``, ``.get()``, ``synchronize()``, data-dependent shapes) and the uploads.

Host synchronisations: on a GPU, the CUPTI waits (context, stream and event
synchronisations; a stream waiting on an event is not a host wait) or, where CUPTI gave
none, the runtime calls that wait (``cuda*Synchronize``), the larger of the two (each is
a subset of the truth; adding them would count a ``cudaStreamSynchronize`` twice), plus
every synchronous ``cudaMemcpy*`` call (it returns once the copy is done); device-to-host
copies are also counted apart (``Memcpy DtoH``). On the stand-in: ``count_transfers``'s
total.

Output: one table per workload (a summary line, then one line per kernel, longest device
time first), and with ``--json PATH`` a document of schema ``refdml-bench/1``
(scripts/_bench.py, one table per workload) with ``rows_schema`` ``refdml.gpu_profile/1``:
``complete``, ``header`` (device, versions, environment, recorders), ``rows`` (one per
workload and mode, the keys of :data:`ROW_KEYS`) and ``kernel_rows`` (one per workload, mode
and kernel, :data:`KERNEL_KEYS`), written atomically (refdml._io) after every workload, so
that a run cut short keeps what it measured. Times are seconds; a quantity a recorder could
not see is null, never 0. A dry run's rows say ``"measurement": false``.

Exit status: 0; 1 a workload failed (its row has ``error``; the others still run); 2 bad
arguments, or no GPU without ``--dry-run`` (one line on stderr).
"""

from __future__ import annotations

import os
import sys

_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _SCRIPTS)
# Before NumPy loads: bench_gpu pins BLAS threads as the benchmarks do.
import bench_gpu  # noqa: E402

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from _bench import Table, clocked, timed_rounds, write_json  # noqa: E402

#: Layout of the ``--json`` document's ``complete``, ``header``, ``rows`` and ``kernel_rows``.
ROWS_SCHEMA = "refdml.gpu_profile/1"
ROW_KEYS = (
    "workload", "kernels", "title", "size", "dtype", "device", "measurement",
    "first_call_s", "wall_s", "wall_rounds_s",
    "refdml_launches", "kernel_launches", "launch_api_calls",
    "host_syncs", "host_syncs_by_kind", "host_syncs_source", "dtoh_copies", "htod_copies",
    "device_kernel_s", "refdml_device_s_events", "recorders", "notes", "error",
)
KERNEL_KEYS = ("workload", "kernels", "kernel", "origin", "launches_recorded",
               "device_s_events", "launches_cupti", "device_s_cupti", "symbol")
WORKLOADS = ("gsp", "train", "retrieval", "kcenter", "sinkhorn")
#: The ``use_kernels`` modes that take CuPy arrays (``"cpu"`` refuses them).
KERNEL_MODES = ("auto", "array", "cuda")
_DRY_NOTE = "dry run (Numba's CUDA simulator, CuPy stand-in): counts only, not a measurement"
#: The ``record_function`` range around the profiled call; API events count inside it only.
_WINDOW = "refdml_gpu_profile_call"


# --------------------------------------------------------------------------- workloads
@dataclasses.dataclass
class Workload:
    """One call to profile: ``call()`` does the work on device arrays built beforehand."""

    name: str
    title: str
    size: str
    call: Callable[[], Any]
    dtype: str = "float32"
    note: str = ""


def _sizes(dry_run: bool, full, dry):
    return dry if dry_run else full


def _gsp(xp, dry_run: bool, mode: str, scratch: str) -> Workload:
    batch, m, n, d = _sizes(dry_run, (256, 64, 49, 128), (1, 3, 4, 8))
    host = bench_gpu._gsp_inputs(batch, m, n, d)
    return Workload("gsp", "GSP pooling forward + backward",
                    f"B={batch} m={m} n={n} d={d} mu={bench_gpu._GSP_ARGS['mu']} "
                    f"inverse_temperature={bench_gpu._GSP_ARGS['inverse_temperature']}",
                    bench_gpu._gsp_layer(xp, host, "float32", mode))


def _train(xp, dry_run: bool, mode: str, scratch: str) -> Workload:
    overrides = _sizes(dry_run, {}, {"n_classes_per_batch": 2, "n_samples_per_class": 2})
    kernels = "array" if dry_run else mode
    step = bench_gpu._TrainStep("cuda", "float32", overrides,
                                os.path.join(scratch, f"train-{mode}"), kernels)
    note = 'dry run: use_kernels("array") (simulated kernels are too slow for a step)' \
        if dry_run else ""
    return Workload("train", "one digits-collage training step (refdml train, Adam)",
                    f"batch {step.batch_size}", step, note=note)


def _retrieval(xp, dry_run: bool, mode: str, scratch: str) -> Workload:
    from refdml.gpu import metrics as fast
    from refdml.gpu import use_kernels

    n_ref, n_query, dim, n_classes = _sizes(dry_run, (200_000, 10_000, 128, 2_000),
                                            (96, 12, 8, 6))
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((n_classes, dim), dtype=np.float32)
    ref_labels = rng.permutation(np.arange(n_ref) % n_classes)
    reference = centres[ref_labels] + 1.5 * rng.standard_normal((n_ref, dim), dtype=np.float32)
    query_labels = rng.integers(0, n_classes, n_query)
    query = centres[query_labels] + 1.5 * rng.standard_normal((n_query, dim), dtype=np.float32)
    reference, ref_labels, query, query_labels = (
        xp.asarray(a) for a in (reference, ref_labels, query, query_labels))

    def call():
        with use_kernels(mode):
            return fast.retrieval_metrics(query, query_labels, reference, ref_labels)
    return Workload("retrieval", "retrieval metrics (Euclidean, Recall@1,2,4,8, MAP@R)",
                    f"{n_query} queries x {n_ref} references of dimension {dim}, "
                    f"{n_classes} classes", call)


def _kcenter(xp, dry_run: bool, mode: str, scratch: str) -> Workload:
    from refdml.gpu import kcenter as fast
    from refdml.gpu import use_kernels

    n, dim, k = _sizes(dry_run, (200_000, 128, 200), (100, 8, 4))
    points = xp.asarray(np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32))

    def call():
        with use_kernels(mode):
            return fast.greedy_k_center(points, k, rng=0)
    return Workload("kcenter", "greedy k-center", f"n={n} d={dim} k={k}", call)


def _sinkhorn(xp, dry_run: bool, mode: str, scratch: str) -> Workload:
    from refdml.gpu import ot as fast
    from refdml.gpu import use_kernels

    # R^128 in the dry run too: tiny clouds in R^8 stall above float32's residual floor.
    n_clouds, n_points, dim = _sizes(dry_run, (256, 49, 128), (4, 5, 128))
    host = bench_gpu._ot_clouds(np.random.default_rng(0), n_clouds, n_points, dim)
    clouds = xp.asarray(host.astype(np.float32))
    problems = n_clouds * (n_clouds - 1) // 2 + n_clouds

    def call():
        with use_kernels(mode):
            return fast.pairwise_sinkhorn_divergence_forward(
                clouds, eps=bench_gpu._OT_EPS, tol=bench_gpu._OT_TOL,
                max_iter=bench_gpu._OT_MAX_ITER)[0]
    return Workload("sinkhorn", "all-pairs Sinkhorn divergence (forward)",
                    f"{n_clouds} clouds of {n_points} points in R^{dim}, p=2, "
                    f"eps={bench_gpu._OT_EPS}, tol={bench_gpu._OT_TOL:g}: {problems} OT problems",
                    call)


BUILDERS = {"gsp": _gsp, "train": _train, "retrieval": _retrieval, "kcenter": _kcenter,
            "sinkhorn": _sinkhorn}


# --------------------------------------------------------------------------- the CUPTI trace
_SYNC_CALLS = frozenset(("cudaDeviceSynchronize", "cudaStreamSynchronize",
                         "cudaEventSynchronize", "cudaThreadSynchronize", "cuCtxSynchronize",
                         "cuStreamSynchronize", "cuEventSynchronize"))
_LAUNCH_CALLS = frozenset(("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
                           "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel"))
#: CUPTI's host waits (kineto's names of CUpti_ActivitySynchronizationType); "Stream Wait
#: Event" is one stream waiting for another, not the host.
_HOST_WAITS = frozenset(("Context Sync", "Stream Sync", "Event Sync"))
_REFDML_KERNEL = re.compile(r"refdml_[a-z_]*[a-z]")


def _api_name(name: str) -> str:
    """``cudaMemcpy_ptds`` -> ``cudaMemcpy``; ``cuLaunchKernel_ptsz`` -> ``cuLaunchKernel``."""
    return re.sub(r"_(ptds|ptsz|v\d+)$", "", name)


def _synchronous_copy(name: str) -> bool:
    """A ``cudaMemcpy*`` / ``cuMemcpy*`` call that returns only once the copy is done."""
    return name.startswith(("cudaMemcpy", "cuMemcpy")) and "Async" not in name


def kernel_origin(name: str) -> str:
    """Who launched a kernel, from its (demangled) name: ``refdml`` (a Numba kernel of
    refdml), ``cupy`` (CuPy's generated kernels are named ``cupy_...``; its sorts and scans
    run CUB's and Thrust's), ``cublas`` (GEMM and GEMV kernels), else ``other``. A heuristic
    on names; the per-kernel rows keep the name."""
    lower = name.lower()
    if _REFDML_KERNEL.search(name):
        return "refdml"
    if "cupy" in lower or re.match(r"(void )?(cub|thrust)\w*::", lower):
        return "cupy"
    if re.search(r"gemm|gemv|cublas|cutlass|xmma|splitkreduce|dot_kernel|nrm2|scal_kernel",
                 lower):
        return "cublas"
    return "other"


def refdml_kernel_name(name: str, known=()) -> str | None:
    """The refdml kernel a device symbol belongs to (``refdml_gsp_pool_forward``): the
    longest of ``known`` it contains, else the first ``refdml_...`` run of its letters
    (which the demangled and the mangled symbol both hold), else None."""
    hits = [k for k in known if k in name]
    if hits:
        return max(hits, key=len)
    match = _REFDML_KERNEL.search(name)
    return match.group(0) if match else None


@dataclasses.dataclass
class TraceSummary:
    """What one profiled call shows in a CUPTI trace (None: not seen by this trace)."""

    kernels: dict                 # symbol -> {"launches": int, "device_s": float}
    kernel_launches: int | None
    launch_api_calls: int | None
    host_syncs: int | None
    host_syncs_by_kind: dict
    dtoh_copies: int | None
    htod_copies: int | None
    device_kernel_s: float | None
    notes: list


def summarize_trace(events: list, window: str = _WINDOW, *, sync_events_requested: bool = True
                    ) -> TraceSummary:
    """Count a chrome trace's events (``export_chrome_trace``'s ``traceEvents``) for the
    call inside the ``record_function`` range named ``window`` (module docstring).

    Host-side events (categories ``cuda_runtime``, ``cuda_driver``, ``cuda_sync``) count
    when they start inside the range; device work (``kernel``, ``gpu_memcpy``) when it
    starts at or after the range's start (it may finish after the range closes).
    """
    notes: list[str] = []
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
                and isinstance(e.get("ts"), (int, float))]
    ranges = [e for e in complete if e.get("name") == window
              and str(e.get("cat", "")).lower() == "user_annotation"]
    if not ranges:
        ranges = [e for e in complete if e.get("name") == window]
    if not ranges:
        return TraceSummary({}, None, None, None, {}, None, None, None,
                            [f"the trace has no range {window!r}: nothing counted"])
    begin = min(float(e["ts"]) for e in ranges)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in ranges)
    categories: dict[str, list] = {}
    for e in complete:
        categories.setdefault(str(e.get("cat", "")).lower(), []).append(e)

    def inside(e):
        return begin <= float(e["ts"]) <= end

    def after(e):
        return float(e["ts"]) >= begin

    kernels: dict[str, dict] = {}
    for e in filter(after, categories.get("kernel", [])):
        entry = kernels.setdefault(str(e.get("name")), {"launches": 0, "device_s": 0.0})
        entry["launches"] += 1
        entry["device_s"] += float(e.get("dur", 0.0)) * 1e-6
    kernel_launches = sum(k["launches"] for k in kernels.values())
    device_kernel_s = sum(k["device_s"] for k in kernels.values())
    if "kernel" not in categories:
        notes.append("CUPTI recorded no kernel in the trace (is CUPTI available to torch?)")
        kernel_launches = device_kernel_s = None

    copies = [e for e in categories.get("gpu_memcpy", []) if after(e)]
    dtoh = sum("DtoH" in str(e.get("name")) for e in copies)
    htod = sum("HtoD" in str(e.get("name")) for e in copies)

    api = [e for cat in ("cuda_runtime", "cuda_driver") for e in categories.get(cat, [])
           if inside(e)]
    if "cuda_runtime" not in categories and "cuda_driver" not in categories:
        notes.append("no CUDA runtime or driver API events in the trace: launch calls and "
                     "synchronous copies not counted")
        launch_calls = None
    else:
        launch_calls = sum(_api_name(str(e.get("name"))) in _LAUNCH_CALLS for e in api)
        if "cuda_driver" not in categories:
            notes.append("no driver API events (cuLaunchKernel) in the trace: Numba's and "
                         "CuPy's launches are missing from the launch calls")
    by_kind: dict[str, int] = {}
    api_waits = 0
    for e in api:
        name = _api_name(str(e.get("name")))
        if name in _SYNC_CALLS:
            api_waits += 1
            by_kind[name] = by_kind.get(name, 0) + 1
        elif _synchronous_copy(name):
            by_kind[name] = by_kind.get(name, 0) + 1
    copies_sync = sum(n for name, n in by_kind.items() if _synchronous_copy(name))
    cupti_waits = 0
    for e in filter(inside, categories.get("cuda_sync", [])):
        name = str(e.get("name"))
        if name in _HOST_WAITS:
            cupti_waits += 1
            by_kind[f"CUPTI {name}"] = by_kind.get(f"CUPTI {name}", 0) + 1
    if "cuda_sync" not in categories:
        notes.append("no CUPTI synchronisation records in the trace"
                     + ("" if sync_events_requested else " (this torch took no "
                        "enable_cuda_sync_events)")
                     + ": waits counted from runtime API calls only (Numba's driver-level "
                       "cuCtxSynchronize and cuStreamSynchronize are not seen)")
    host_syncs = None if launch_calls is None and "cuda_sync" not in categories else (
        max(api_waits, cupti_waits) + copies_sync)
    return TraceSummary(kernels, kernel_launches, launch_calls, host_syncs, by_kind,
                        dtoh if "gpu_memcpy" in categories else None,
                        htod if "gpu_memcpy" in categories else None, device_kernel_s, notes)


class _TorchTrace:
    """torch.profiler around one call (module docstring); ``summary`` after the block."""

    def __init__(self, torch, scratch: str):
        self.torch = torch
        self.scratch = scratch
        self.summary: TraceSummary | None = None
        self.notes: list[str] = []
        self.calling = False          # True while the traced call runs (its own errors)

    @contextlib.contextmanager
    def window(self, sync: Callable[[], None]):
        from torch.profiler import ProfilerActivity, profile, record_function

        kwargs: dict = dict(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        requested = False
        try:
            from torch._C._profiler import _ExperimentalConfig

            kwargs["experimental_config"] = _ExperimentalConfig(enable_cuda_sync_events=True)
            requested = True
        except (ImportError, TypeError, AttributeError) as exc:
            self.notes.append(f"CUPTI synchronisation records not requested "
                              f"({type(exc).__name__}: {exc})")
        self.summary, self.calling = None, False
        with profile(**kwargs) as prof:
            with record_function(_WINDOW):
                self.calling = True
                yield
                self.calling = False
            sync()                    # outside the range: the device finishes the call's work
        path = os.path.join(self.scratch, "trace.json")
        try:
            prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as handle:
                trace = json.load(handle)
        except (OSError, ValueError, RuntimeError) as exc:
            self.notes.append(f"the CUPTI trace could not be read ({type(exc).__name__}: {exc})")
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        self.summary = summarize_trace(events, sync_events_requested=requested)


def _torch_profiler(dry_run: bool, no_torch: bool) -> tuple[Any, str]:
    """(torch, what it is) where torch's profiler can trace this GPU, else (None, why not)."""
    if dry_run:
        return None, "dry run: no CUPTI"
    if no_torch:
        return None, "--no-torch"
    try:
        import torch
        import torch.profiler  # noqa: F401
    except Exception as exc:                  # ImportError, or a torch that fails to load
        return None, f"torch not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, f"torch {torch.__version__} profiler (CUPTI)"


# --------------------------------------------------------------------------- one workload
@contextlib.contextmanager
def _transfer_counter(standin: bool):
    if not standin:
        yield None
        return
    import cupy_standin

    with cupy_standin.count_transfers() as counter:
        yield counter


def profile_workload(work: Workload, *, mode: str, sync, repeats: int, max_seconds: float,
                     standin: bool, torch_trace: _TorchTrace | None, dry_run: bool,
                     device: str) -> tuple[dict, list[dict]]:
    """The row and the kernel rows of one workload (module docstring)."""
    from refdml.gpu._support.profile import launch_profile

    notes = [n for n in (work.note, _DRY_NOTE if dry_run else "") if n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_s, _ = clocked(work.call, sync)
    notes += sorted({f"first call warned: {w.category.__name__}: {w.message}" for w in caught})
    rounds = timed_rounds({"call": work.call}, repeats, sync=sync, max_s=max_seconds)["call"]

    sync()
    with _transfer_counter(standin) as transfers, launch_profile() as launches:
        traced = False
        if torch_trace is not None:
            try:
                with torch_trace.window(sync):
                    work.call()
                traced = True
            except Exception as exc:
                if torch_trace.calling:             # the call failed, not the profiler
                    raise
                notes.append(f"torch's profiler failed ({type(exc).__name__}: {exc}): "
                             "the call ran untraced")
        if not traced:
            work.call()
    recorders = []
    if launches.enabled:
        recorders.append("refdml launch recorder" + (" (CUDA events)" if launches.timed
                                                     else " (counts)"))
    else:
        notes.append("REFDML_CUDA_PROFILE is not 1: refdml's launch recorder off")
    trace = torch_trace.summary if traced else None
    if torch_trace is not None:
        notes += torch_trace.notes
        torch_trace.notes = []
    if trace is not None:
        recorders.append("torch profiler (CUPTI)")
        notes += trace.notes
    if transfers is not None:
        recorders.append("CuPy stand-in count_transfers")

    syncs, by_kind, source, dtoh, htod = None, {}, None, None, None
    if transfers is not None:
        syncs, by_kind, source = transfers.total, dict(transfers.by_kind), "CuPy stand-in"
        dtoh = sum(n for kind, n in transfers.by_kind.items() if kind != "synchronize")
        htod = transfers.uploads
    elif trace is not None:
        syncs, by_kind, source = trace.host_syncs, trace.host_syncs_by_kind, "CUPTI"
        dtoh, htod = trace.dtoh_copies, trace.htod_copies
    else:
        notes.append("host synchronisations not counted (no CUPTI trace, no stand-in)")

    kernel_rows = _kernel_rows(work.name, mode, launches, trace)
    events_s = None
    if launches.device_seconds is not None:
        events_s = sum(launches.device_seconds.values())
    row = {
        "workload": work.name, "kernels": mode, "title": work.title, "size": work.size,
        "dtype": work.dtype, "device": device, "measurement": not dry_run,
        "first_call_s": first_s, "wall_s": statistics.median(rounds), "wall_rounds_s": rounds,
        "refdml_launches": launches.total_launches if launches.enabled else None,
        "kernel_launches": trace.kernel_launches if trace else None,
        "launch_api_calls": trace.launch_api_calls if trace else None,
        "host_syncs": syncs, "host_syncs_by_kind": dict(sorted(by_kind.items())),
        "host_syncs_source": source, "dtoh_copies": dtoh, "htod_copies": htod,
        "device_kernel_s": trace.device_kernel_s if trace else None,
        "refdml_device_s_events": events_s, "recorders": recorders, "notes": notes,
        "error": None,
    }
    return row, kernel_rows


def _kernel_rows(workload: str, mode: str, launches, trace: TraceSummary | None) -> list[dict]:
    """One row per kernel: refdml's by name (the recorder's and CUPTI's joined), the others by
    their symbol; longest device time first."""
    rows: dict[str, dict] = {}

    def row(key, origin, symbol=None):
        return rows.setdefault(key, dict.fromkeys(KERNEL_KEYS) | {
            "workload": workload, "kernels": mode, "kernel": key, "origin": origin,
            "symbol": symbol})

    for name, count in launches.launches.items():
        entry = row(name, "refdml")
        entry["launches_recorded"] = count
        if launches.device_seconds is not None:
            entry["device_s_events"] = launches.device_seconds.get(name)
    for symbol, seen in (trace.kernels if trace else {}).items():
        name = refdml_kernel_name(symbol, launches.launches)
        entry = row(name, "refdml", symbol) if name else row(symbol, kernel_origin(symbol))
        entry["symbol"] = entry["symbol"] or symbol
        entry["launches_cupti"] = (entry["launches_cupti"] or 0) + seen["launches"]
        entry["device_s_cupti"] = (entry["device_s_cupti"] or 0.0) + seen["device_s"]

    def order(entry):
        seconds = entry["device_s_cupti"] if entry["device_s_cupti"] is not None else (
            entry["device_s_events"] or 0.0)
        return (-seconds, -(entry["launches_cupti"] or entry["launches_recorded"] or 0),
                entry["kernel"])
    return sorted(rows.values(), key=order)


# --------------------------------------------------------------------------- output
def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def _count(value) -> str | int:
    return "" if value is None else int(value)


_KERNEL_COLUMNS = ["kernel", "origin", "launches (CUPTI)", "device ms (CUPTI)",
                   "launches (recorder)", "device ms (events)"]


def workload_table(row: dict, kernel_rows: list[dict]) -> Table:
    """The printed table of one workload, cell by cell as in the JSON's ``tables``."""
    table = Table(f"{row['workload']} (use_kernels(\"{row['kernels']}\")): {row['title']}, "
                  f"{row['size']}, {row['dtype']}, {row['device']}", _KERNEL_COLUMNS,
                  notes=[_summary_line(row)] + row["notes"])
    for k in kernel_rows:
        name = k["kernel"] if len(k["kernel"]) <= 72 else k["kernel"][:69] + "..."
        table.add(name, k["origin"], _count(k["launches_cupti"]), _ms(k["device_s_cupti"]),
                  _count(k["launches_recorded"]), _ms(k["device_s_events"]))
    if row["error"]:
        table.note(f"ERROR {row['error']}")
    return table


def _summary_line(row: dict) -> str:
    def value(key, unit=""):
        v = row.get(key)
        return "not seen" if v is None else f"{v}{unit}"
    parts = []
    if row.get("wall_s") is not None:
        parts.append(f"wall {_ms(row['wall_s'])} ms per call (median of "
                     f"{len(row['wall_rounds_s'])}; first call {_ms(row['first_call_s'])} ms)")
    parts.append(f"refdml launches {value('refdml_launches')}")
    parts.append(f"all kernels (CUPTI) {value('kernel_launches')}")
    parts.append(f"launch API calls {value('launch_api_calls')}")
    syncs = value("host_syncs")
    if row.get("host_syncs_by_kind"):
        syncs += " (" + ", ".join(f"{k} {n}" for k, n in row["host_syncs_by_kind"].items()) + ")"
    parts.append(f"host syncs {syncs}" + (f" [{row['host_syncs_source']}]"
                                          if row.get("host_syncs_source") else ""))
    parts.append(f"device-to-host copies {value('dtoh_copies')}, uploads {value('htod_copies')}")
    if row.get("device_kernel_s") is not None:
        parts.append(f"device kernel time (CUPTI) {_ms(row['device_kernel_s'])} ms")
    if row.get("refdml_device_s_events") is not None:
        parts.append(f"refdml kernels' event spans {_ms(row['refdml_device_s_events'])} ms")
    return "; ".join(parts)


def _print_table(table: Table) -> None:
    print(f"\n{table.title}")
    for note in table.notes:
        print(f"  {note}")
    if not table.rows:
        return
    widths = [max(len(str(c)) for c in column) for column in zip(table.columns, *table.rows)]
    for cells in [table.columns, *table.rows]:
        print("  " + "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    sys.stdout.flush()


def _header(xp, dry_run: bool, recorders: dict) -> dict:
    import datetime

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": dry_run, "note": _DRY_NOTE if dry_run else "",
        "device": bench_gpu._device_header(xp), "versions": bench_gpu._versions_header(xp),
        "environment": {name: os.environ.get(name) for name in (
            "NUMBA_ENABLE_CUDASIM", "REFDML_CUPY_STANDIN", "REFDML_CUDA_PROFILE",
            "REFDML_CUDA_LAUNCH_SYNC", "REFDML_GPU_KERNELS", "OPENBLAS_NUM_THREADS")},
        "recorders": recorders,
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
        "workloads_s": {},
    }


def _write(path: str | None, *, argv, tables, header, rows, kernel_rows, complete) -> None:
    if path is None:
        return
    name = header.get("device", {}).get("name")
    device = ("cuda (dry run: simulator + CuPy stand-in)" if header["dry_run"]
              else name or "cuda")
    notes = ["wall: one call between two device synchronisations, median of the rounds; the "
             "per-kernel and count columns come from one more call under the recorders named "
             "in each row (scripts/gpu_profile.py's docstring)"]
    if header["dry_run"]:
        notes.append(_DRY_NOTE)
    write_json(path, script=__file__, argv=argv, tables=tables, notes=notes, device=device,
               extra={"complete": complete, "header": header, "rows_schema": ROWS_SCHEMA,
                      "rows": bench_gpu._finite(rows),
                      "kernel_rows": bench_gpu._finite(kernel_rows)})


# --------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """Bad input: one line on stderr naming the flag, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--repeats == {text!r}, must be an integer >= 1") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--repeats == {value}, must be an integer >= 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--max-seconds == {text!r}, must be a number >= 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="gpu_profile.py", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"profile only this workload (repeatable): {', '.join(WORKLOADS)}")
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_MODES, default=["auto"],
                        metavar="MODE", help="use_kernels modes to profile each workload under "
                        f"({', '.join(KERNEL_MODES)}; default auto)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="timed calls per workload, median (default 5; dry run 1)")
    parser.add_argument("--max-seconds", type=_seconds, default=10.0,
                        help="stop a workload's timed calls once they took this long (after one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CuPy stand-in under Numba's CUDA simulator "
                             "(no GPU; CI): counts launches and host transfers, times nothing")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave torch's profiler (CUPTI) out: refdml's recorder only")
    parser.add_argument("--json", metavar="PATH", help="write the document to PATH atomically")
    args = parser.parse_args(argv)
    if args.json is not None:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            parser.error(f"--json {args.json}: folder {folder} does not exist")
    repeats = args.repeats or (1 if args.dry_run else 5)
    workloads = list(dict.fromkeys(args.only or WORKLOADS))
    modes = list(dict.fromkeys(args.kernels))

    os.environ.setdefault("REFDML_CUDA_PROFILE", "1")
    reason = bench_gpu._prepare_cuda(args.dry_run)
    if reason is not None:
        print(f"gpu_profile.py: {reason}", file=sys.stderr)
        return 2
    import cupy

    warnings.filterwarnings("ignore", message="Grid size .* under-utilization")
    sync = cupy.cuda.Device().synchronize
    standin = bool(getattr(cupy, "__refdml_standin__", False))
    torch, torch_note = _torch_profiler(args.dry_run, args.no_torch)
    from refdml.gpu._support.profile import _profile_switch

    recorders = {"refdml_launch_recorder": "on" if _profile_switch() else
                 "off (REFDML_CUDA_PROFILE is not 1)",
                 "cupti": torch_note if torch is not None else f"off: {torch_note}",
                 "cupy_standin": "count_transfers" if standin else "off"}
    header = _header(cupy, args.dry_run, recorders)
    device = "cuda (dry run)" if args.dry_run else header["device"].get("name", "cuda")
    print(f"gpu_profile.py{' --dry-run' if args.dry_run else ''}: {device}; recorders: "
          + "; ".join(f"{k} {v}" for k, v in recorders.items()), flush=True)
    rows: list[dict] = []
    kernel_rows: list[dict] = []
    tables: list[Table] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="refdml-gpu-profile-") as scratch:
        trace = _TorchTrace(torch, scratch) if torch is not None else None
        document = dict(argv=argv, tables=tables, header=header, rows=rows,
                        kernel_rows=kernel_rows)
        try:
            _write(args.json, complete=False, **document)
        except OSError as exc:
            print(f"gpu_profile.py: error: --json {args.json}: {exc}", file=sys.stderr)
            return 2
        for name in workloads:
            for mode in modes:
                start = time.perf_counter()
                try:
                    work = BUILDERS[name](cupy, args.dry_run, mode, scratch)
                    row, kernels = profile_workload(
                        work, mode=mode, sync=sync, repeats=repeats,
                        max_seconds=args.max_seconds, standin=standin, torch_trace=trace,
                        dry_run=args.dry_run, device=device)
                except Exception as exc:          # out of memory, a kernel fault, ...
                    traceback.print_exc()
                    failed = True
                    row = dict.fromkeys(ROW_KEYS) | {
                        "workload": name, "kernels": mode, "device": device,
                        "measurement": False, "notes": [], "recorders": [],
                        "host_syncs_by_kind": {}, "wall_rounds_s": [], "title": name,
                        "size": "", "dtype": "float32", "error": f"{type(exc).__name__}: {exc}"}
                    kernels = []
                finally:
                    bench_gpu._free_device_memory(cupy)
                header["workloads_s"][f"{name} {mode}"] = round(time.perf_counter() - start, 3)
                rows.append(row)
                kernel_rows.extend(kernels)
                tables.append(workload_table(row, kernels))
                _print_table(tables[-1])
                _write(args.json, complete=False, **document)
        _write(args.json, complete=True, **document)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
