"""scripts/gpu_profile.py and the launch recorder it reads (refdml.gpu._support.profile's
``launch_profile``, inside ``cuda_launch``).

The recorder counts a real refdml kernel's launches under Numba's CUDA simulator; its GPU
branch (CUDA events on the launch stream, one synchronisation at the end) is checked with
stand-ins for Numba's functions, as tests/gpu/test_cuda_launch.py checks the launcher's.
The CUPTI trace reader runs on a hand-made trace of the chrome-trace format. The dry run
of the script runs for real (CuPy stand-in, simulator) at toy size. Nothing asserts a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from refdml.gpu._support import launch as _launch
from refdml.gpu._support import profile as _profile
from refdml.gpu._support.launch import cuda_launch
from refdml.gpu._support.profile import launch_profile

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
simulated = pytest.mark.skipif(not _launch.cuda_simulator(), reason="needs Numba's CUDA simulator")


def _load_script():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("gpu_profile_under_test",
                                                  SCRIPTS / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


profile_script = _load_script()


class _RecordingKernel:
    """``kernel[grid, block(, stream)](*args)`` that records its launches (named by
    ``py_func`` as a numba-cuda dispatcher is)."""

    def __init__(self, name="refdml_fake_kernel", log=None):
        self.py_func = types.SimpleNamespace(__name__=name)
        self.log = log if log is not None else []

    def __getitem__(self, config):
        return lambda *args: self.log.append(("launch", self.py_func.__name__, config))


# --------------------------------------------------------------------------- the recorder
@pytest.mark.requires_cuda
def test_recorder_counts_the_gsp_layer_kernels(monkeypatch, cuda_device_array):
    # refdml/gpu/gsp/_kernels.py: pool_forward launches refdml_gsp_normalise once (the clip and
    # the norms) and refdml_gsp_pool_forward once (one block per image: cost map, (P2),
    # weights, pooled and z in one kernel); pool_backward launches refdml_gsp_pool_backward
    # once (W, d features and the column sums of W) and refdml_gsp_prototypes_backward once
    # after the GEMM of the prototypes' gradient. Finite gradients take no float64 rerun.
    from refdml.gpu import use_kernels
    from refdml.gpu import gsp

    monkeypatch.setenv("REFDML_CUDA_PROFILE", "1")
    rng = np.random.default_rng(0)
    features = cuda_device_array(rng.standard_normal((1, 4, 5)).astype(np.float32))
    prototypes = cuda_device_array(rng.standard_normal((3, 5)).astype(np.float32))
    with use_kernels("cuda"), launch_profile() as both:
        with launch_profile() as forward:
            (pooled, z), ctx = gsp.gsp_pool_forward(features, prototypes, mu=0.3,
                                                    inverse_temperature=5.0)
        with launch_profile() as backward:
            gsp.gsp_pool_backward(ctx, pooled, z)
    assert dict(forward.launches) == {"refdml_gsp_normalise": 1, "refdml_gsp_pool_forward": 1}
    assert dict(backward.launches) == {"refdml_gsp_pool_backward": 1,
                                       "refdml_gsp_prototypes_backward": 1}
    assert dict(both.launches) == {**forward.launches, **backward.launches}
    assert both.total_launches == 4
    if _launch.cuda_simulator():           # no device clock: counts only
        assert not both.timed and both.device_seconds is None
    else:                                   # a GPU: each launch between two CUDA events
        assert both.timed and set(both.device_seconds) == set(both.launches)
        assert all(seconds > 0 for seconds in both.device_seconds.values())
        assert forward.device_seconds.keys() == {"refdml_gsp_normalise",
                                                 "refdml_gsp_pool_forward"}
    assert both.as_dict()["launches"] == {"refdml_gsp_normalise": 1,
                                         "refdml_gsp_pool_backward": 1,
                                         "refdml_gsp_pool_forward": 1,
                                         "refdml_gsp_prototypes_backward": 1}
    assert _profile._RECORDS == []


@simulated
def test_recorder_is_off_without_the_switch(monkeypatch):
    monkeypatch.delenv("REFDML_CUDA_PROFILE", raising=False)
    monkeypatch.setattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", [])
    kernel = _RecordingKernel()
    with launch_profile() as record:
        assert _profile._RECORDS == []           # nothing for cuda_launch to do
        cuda_launch(kernel, 1, 32, np.zeros(3))
    assert kernel.log == [("launch", "refdml_fake_kernel", (1, 32))]
    assert not record.enabled and record.total_launches == 0
    assert record.as_dict() == {"enabled": False, "timed": False, "launches": {},
                                "device_seconds": None}
    assert "disabled" in repr(record)


@simulated
def test_recorder_counts_every_launch_of_its_block_only(monkeypatch):
    monkeypatch.setenv("REFDML_CUDA_PROFILE", "1")
    monkeypatch.setattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", [])
    first, second = _RecordingKernel("refdml_a"), _RecordingKernel("refdml_b")
    cuda_launch(first, 1, 32)                    # before the block: not counted
    with launch_profile() as record:
        for _ in range(3):
            cuda_launch(first, 1, 32)
        cuda_launch(second, 2, 32)
    cuda_launch(second, 1, 32)                   # after the block: not counted
    assert dict(record.launches) == {"refdml_a": 3, "refdml_b": 1}


class _FakeCuda:
    """The numba.cuda functions the hardware branch calls, recorded in one log."""

    def __init__(self, log):
        self.log = log
        self.events = 0

    def as_cuda_array(self, obj, sync=True):
        return ("view", obj)

    def legacy_default_stream(self):
        return "legacy"

    def per_thread_default_stream(self):
        return "per-thread"

    def external_stream(self, ptr):
        return f"external {ptr:#x}"

    def default_stream(self):
        return "default"

    def event(self, timing=True):
        assert timing
        self.events += 1
        log, number = self.log, self.events

        class Event:
            ms = 0.5 * number               # elapsed(start, end) = end.ms - start.ms

            def record(self, stream=0):
                log.append(("record", number, stream))
        return Event()

    def synchronize(self):
        self.log.append(("synchronize",))

    def event_elapsed_time(self, start, end):
        return end.ms - start.ms


class _DeviceLike:
    def __init__(self, stream):
        self.__cuda_array_interface__ = {"shape": (2,), "typestr": "<f8", "data": (0, False),
                                         "version": 3, "stream": stream}


@pytest.fixture
def hardware(monkeypatch):
    """cuda_launch's GPU branch with Numba's functions recorded (the one import point of
    numba.cuda, refdml.gpu._support.cuda, made to hand out the fake)."""
    import refdml.gpu._support.cuda as cuda_module

    log: list = []
    fake = _FakeCuda(log)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    monkeypatch.delenv("REFDML_CUDA_LAUNCH_SYNC", raising=False)
    monkeypatch.setenv("REFDML_CUDA_PROFILE", "1")
    monkeypatch.setattr(cuda_module, "cuda", fake)
    return fake


def test_recorder_on_a_gpu_brackets_each_launch_with_events_on_its_stream(hardware):
    kernel = _RecordingKernel("refdml_k", log=hardware.log)
    other = _RecordingKernel("refdml_other", log=hardware.log)
    array = _DeviceLike(0x7F00)
    with launch_profile() as record:
        cuda_launch(kernel, 4, 128, array)
        cuda_launch(other, 1, 128, array)
        cuda_launch(kernel, 4, 128, array)
        assert ("synchronize",) not in hardware.log     # nothing waits inside the block
    stream = "external 0x7f00"
    assert hardware.log == [
        ("record", 1, stream), ("launch", "refdml_k", (4, 128, stream)), ("record", 2, stream),
        ("record", 3, stream), ("launch", "refdml_other", (1, 128, stream)),
        ("record", 4, stream),
        ("record", 5, stream), ("launch", "refdml_k", (4, 128, stream)), ("record", 6, stream),
        ("synchronize",),                                # one, when the block ends
    ]
    assert record.timed and dict(record.launches) == {"refdml_k": 2, "refdml_other": 1}
    # each span 0.5 ms (consecutive events): two launches of refdml_k, one of the other
    assert record.device_seconds == pytest.approx({"refdml_k": 1e-3, "refdml_other": 0.5e-3})


def test_recorder_on_a_gpu_records_the_default_stream_of_a_synchronising_launch(
        hardware, monkeypatch):
    monkeypatch.setenv("REFDML_CUDA_LAUNCH_SYNC", "1")
    kernel = _RecordingKernel(log=hardware.log)
    with launch_profile(timing=True) as record:
        cuda_launch(kernel, 1, 32, _DeviceLike(0x7F00))
    assert hardware.log[:3] == [("record", 1, "default"), ("launch", "refdml_fake_kernel",
                                                            (1, 32)), ("record", 2, "default")]
    assert record.launches["refdml_fake_kernel"] == 1


def test_recorder_on_a_gpu_costs_nothing_when_no_record_is_open(hardware):
    kernel = _RecordingKernel(log=hardware.log)
    cuda_launch(kernel, 1, 32, _DeviceLike(1))
    assert hardware.log == [("launch", "refdml_fake_kernel", (1, 32, "legacy"))]
    assert hardware.events == 0
    with launch_profile(timing=False) as record:        # counts only: no events either
        cuda_launch(kernel, 1, 32, _DeviceLike(1))
    assert hardware.events == 0 and record.launches["refdml_fake_kernel"] == 1
    assert record.device_seconds is None and ("synchronize",) not in hardware.log


# --------------------------------------------------------------------------- the CUPTI trace
def _event(cat, name, ts, dur=1.0):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


_MANGLED = "_ZN6cudapy6refdml3gpu7_nb_gsp12cuda_kernels12_3clocals_3e23refdml_gsp_pool_forward241B"


def test_trace_reader_counts_inside_the_call_window():
    events = [
        {"ph": "M", "name": "process_name", "ts": 0},
        _event("kernel", "cupy_copy__float32_float32", 50, 3.0),      # before the call
        _event("user_annotation", profile_script._WINDOW, 100, 100),
        _event("cuda_driver", "cuLaunchKernel", 110),
        _event("kernel", _MANGLED, 115, 10.0),
        _event("cuda_runtime", "cudaLaunchKernel", 120),
        _event("kernel", "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize", 125, 4.0),
        _event("cuda_driver", "cuLaunchKernel", 130),
        _event("kernel", "cupy_multiply__float32_float32_float32", 135, 2.0),
        _event("cuda_runtime", "cudaMemcpy", 140, 5.0),               # synchronous copy
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 142, 1.0),
        _event("cuda_runtime", "cudaMemcpyAsync", 150),               # not a wait
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 151, 1.0),
        _event("cuda_runtime", "cudaStreamSynchronize", 160),
        _event("cuda_sync", "Stream Sync", 160),                       # the same wait
        _event("cuda_sync", "Context Sync", 170),                      # Numba's cuCtxSynchronize
        _event("cuda_sync", "Stream Wait Event", 175),                 # not the host
        _event("kernel", _MANGLED, 190, 10.0),
        _event("cuda_runtime", "cudaDeviceSynchronize", 250),         # the profiler's own
        _event("cuda_sync", "Context Sync", 250),
    ]
    trace = profile_script.summarize_trace(events)
    assert trace.kernel_launches == 4
    assert trace.kernels[_MANGLED] == {"launches": 2, "device_s": pytest.approx(20e-6)}
    assert trace.device_kernel_s == pytest.approx(26e-6)
    assert trace.launch_api_calls == 3
    # waits: max(1 runtime call, 2 CUPTI host waits) + 1 synchronous copy
    assert trace.host_syncs == 3
    assert trace.host_syncs_by_kind == {"cudaStreamSynchronize": 1, "cudaMemcpy": 1,
                                        "CUPTI Stream Sync": 1, "CUPTI Context Sync": 1}
    assert (trace.dtoh_copies, trace.htod_copies) == (1, 1)
    assert trace.notes == []

    launches = types.SimpleNamespace(launches={"refdml_gsp_pool_forward": 2},
                                     device_seconds={"refdml_gsp_pool_forward": 25e-6})
    rows = profile_script._kernel_rows("gsp", "auto", launches, trace)
    by_name = {row["kernel"]: row for row in rows}
    joined = by_name["refdml_gsp_pool_forward"]            # recorder and CUPTI on one row
    assert (joined["launches_recorded"], joined["launches_cupti"]) == (2, 2)
    assert joined["symbol"] == _MANGLED and joined["origin"] == "refdml"
    assert rows[0]["kernel"] == "refdml_gsp_pool_forward"  # longest device time first
    assert {row["origin"] for row in rows} == {"refdml", "cublas", "cupy"}
    assert all(set(row) == set(profile_script.KERNEL_KEYS) for row in rows)


def test_trace_reader_says_what_it_could_not_see():
    events = [_event("user_annotation", profile_script._WINDOW, 0, 100),
              _event("kernel", "refdml_retrieval_topk(Array<float, 2, C>)", 10, 5.0),
              _event("cuda_runtime", "cudaStreamSynchronize_ptsz", 20)]
    trace = profile_script.summarize_trace(events, sync_events_requested=False)
    assert trace.host_syncs == 1 and trace.launch_api_calls == 0
    assert trace.dtoh_copies is None                       # no memcpy category: unknown
    notes = " ".join(trace.notes)
    assert "no driver API events" in notes and "no CUPTI synchronisation records" in notes
    assert "enable_cuda_sync_events" in notes
    empty = profile_script.summarize_trace([_event("kernel", "k", 0)])
    assert empty.kernel_launches is None and empty.host_syncs is None
    assert "no range" in empty.notes[0]


@pytest.mark.parametrize("symbol, origin", [
    ("cudapy::refdml::gpu::_nb_kcenter::refdml_kcenter_update[abi:v1](Array<float>)", "refdml"),
    ("cupy_sum_float32_float32", "cupy"),
    ("void cub::CUB_300001_SM_900::DeviceRadixSortOnesweepKernel<Policy>(int*)", "cupy"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(Params)", "cublas"),
    ("void at::native::vectorized_elementwise_kernel<4>", "other"),
])
def test_kernel_origin(symbol, origin):
    assert profile_script.kernel_origin(symbol) == origin


# --------------------------------------------------------------------------- the document
def _row(**fields):
    row = dict.fromkeys(profile_script.ROW_KEYS) | {
        "workload": "kcenter", "kernels": "auto", "title": "greedy k-center", "size": "n=4",
        "dtype": "float32", "device": "cuda (dry run)", "measurement": False, "notes": [],
        "recorders": [], "host_syncs_by_kind": {}, "wall_rounds_s": [0.5], "wall_s": 0.5,
        "first_call_s": 1.0, "refdml_launches": 3}
    return row | fields


def test_json_document_is_written_atomically_with_its_schema(tmp_path):
    path = tmp_path / "profile.json"
    header = {"dry_run": True, "device": {"name": "stand-in"}}
    kernel = dict.fromkeys(profile_script.KERNEL_KEYS) | {
        "workload": "kcenter", "kernels": "auto", "kernel": "refdml_kcenter_pick",
        "origin": "refdml", "launches_recorded": 3}
    row = _row()
    table = profile_script.workload_table(row, [kernel])
    profile_script._write(str(path), argv=["--dry-run"], tables=[table], header=header,
                          rows=[row], kernel_rows=[kernel], complete=True)
    document = json.loads(path.read_text())
    assert document["schema"] == "refdml-bench/1"
    assert document["rows_schema"] == profile_script.ROWS_SCHEMA == "refdml.gpu_profile/1"
    assert document["complete"] is True and document["header"] == header
    assert [set(r) for r in document["rows"]] == [set(profile_script.ROW_KEYS)]
    assert document["kernel_rows"] == [kernel]
    assert document["tables"][0]["rows"] == [["refdml_kcenter_pick", "refdml", "", "", 3, ""]]
    assert document["command"] == "python scripts/gpu_profile.py --dry-run"

    # A document that cannot be written leaves the previous file whole, and no temporary.
    before = path.read_bytes()
    with pytest.raises(TypeError):
        profile_script._write(str(path), argv=[], tables=[table], header=header,
                              rows=[_row(notes=[object()])], kernel_rows=[], complete=False)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


# --------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("argv, flag", [
    (["--repeats", "0"], "--repeats"), (["--only", "nothing"], "--only"),
    (["--kernels", "cpu"], "--kernels"), (["--max-seconds", "-1"], "--max-seconds"),
    (["--json", "/no/such/folder/p.json"], "--json"), (["--frobnicate"], "--frobnicate"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        profile_script.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


def _run_script(args, tmp_path, **env):
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("NUMBA_ENABLE_CUDASIM", "REFDML_CUPY_STANDIN",
                                  "REFDML_CUDA_PROFILE", "REFDML_GPU_KERNELS")}
    environment.update(env)
    return subprocess.run([sys.executable, str(SCRIPTS / "gpu_profile.py"), *args],
                          cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=300)


def test_without_a_gpu_it_says_so_on_one_line(tmp_path):
    done = _run_script([], tmp_path, NUMBA_ENABLE_CUDASIM="1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "--dry-run" in done.stderr


def test_dry_run_counts_launches_and_host_transfers(tmp_path):
    # The kernel workloads at toy size on the CuPy stand-in under the simulator: the
    # recorder in cuda_launch counts refdml's launches, the stand-in the host transfers.
    # "cuda": retrieval's "auto" on CuPy is its array path, which launches no refdml kernel.
    path = tmp_path / "profile.json"
    done = _run_script(["--dry-run", "--only", "retrieval", "--only", "sinkhorn",
                        "--kernels", "cuda", "--json", str(path)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(path.read_text())
    assert document["complete"] is True and document["header"]["dry_run"] is True
    assert document["header"]["recorders"]["refdml_launch_recorder"] == "on"
    rows = {row["workload"]: row for row in document["rows"]}
    assert sorted(rows) == ["retrieval", "sinkhorn"]
    for row in rows.values():
        assert set(row) == set(profile_script.ROW_KEYS)
        assert row["error"] is None and row["measurement"] is False
        assert row["refdml_launches"] > 0, row
        assert row["host_syncs_source"] == "CuPy stand-in"
        assert row["host_syncs"] == sum(row["host_syncs_by_kind"].values()) > 0
        assert row["kernel_launches"] is None and row["device_kernel_s"] is None  # no CUPTI
        assert row["refdml_device_s_events"] is None                            # no events
    kernels = {(k["workload"], k["kernel"]): k for k in document["kernel_rows"]}
    assert kernels["retrieval", "refdml_retrieval_topk"]["launches_recorded"] >= 1
    assert kernels["sinkhorn", "refdml_ot_sinkhorn_small"]["launches_recorded"] >= 1
    for workload in ("retrieval", "sinkhorn"):
        assert rows[workload]["refdml_launches"] == sum(
            k["launches_recorded"] for (w, _), k in kernels.items() if w == workload)
    assert "refdml_retrieval_topk" in done.stdout and "refdml_ot_sinkhorn_small" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]
