#!/usr/bin/env bash
# One command for a GPU machine (issue 21; docs/gpu/gpu-machine.md, "Running on a GPU machine").
#
#   bash scripts/gpu_prepare.sh        # here, with network: the wheels, into .whl/
#   bash scripts/gpu_run.sh            # there, from the repository root, with .whl/ carried
#   bash scripts/gpu_run.sh --dry-run  # anywhere without a GPU (CI): the same steps on
#                                      # Numba's CUDA simulator and the CuPy stand-in
#
# Installs refdml from its wheel (and the carried wheels: POT) into a folder of its own,
# never from the network, and runs every step from an empty temporary folder: from the
# repository root the source refdml/ would shadow the wheel (the checkout would be tested). Steps, in
# order, each with its own time limit and exit status, none stopping the others: install,
# smoke, compile (refdml gpu-check --compile-only), parity (refdml gpu-check), tests (the
# GPU test files, in parallel with pytest-xdist where it is installed), crosscheck (the
# CPU-vs-GPU training trajectory test), bench (scripts/bench_gpu.py --device cuda, with
# its PyTorch anchor rows where torch sees the GPU), torch_bench (scripts/bench_torch_gsp.py
# --device cuda: refdml.torch.GSPPool in a PyTorch step against the authors' layer, on CUDA
# tensors; it skips, saying why, without torch, CUDA in torch or CuPy), profile (scripts/gpu_profile.py:
# device time per kernel, launches and host synchronisations per call of five workloads),
# train (refdml train --study tokens --device cuda).
# The steps share a budget of 525 s, so that the whole call ends within 9 minutes
# (--dry-run: 285 s, under 5 minutes; REFDML_GPU_RUN_BUDGET_S overrides).
#
# Results go to $OUT when set, else to gpu_run_out/ (ignored): gpu_run.log, gpu_ledger.json
# (scripts/gpu_ledger.py), the two gpu-check tables, the JUnit XML of the two test steps,
# and gpu_run_files.tar.gz with everything else: seven files, as a GPU host that returns
# at most eight files of a folder, none deeper than two levels, can send them all back.
#
# Numba's and CuPy's kernel caches and the installed wheels live in .gpu_cache/ (ignored),
# so a second call on the same machine reuses them.
#
# REFDML_GPU_GLYPH_COLLAGE=1 makes it a call of its own for the glyph-collage experiment
# (docs/gpu/gpu-machine.md, "The glyph-collage run"): install, smoke, then glyph_collage
# (scripts/gpu_glyph_collage.py, the rest of the budget; --dry-run: its CPU dry run), whose
# glyph_collage.json and README (glyph_collage_README.md) come back beside the ledger and
# its figures in the archive. Unset or 0: the steps above, unchanged.
#
# Exit status: 0 every step passed; 1 a step failed, timed out or was skipped; 2 bad
# arguments. A summary table of the steps is printed last.

set -uo pipefail

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_run.sh: error: unknown argument '$arg' (only --dry-run, --help)" >&2; exit 2 ;;
    esac
done
GLYPH_COLLAGE=${REFDML_GPU_GLYPH_COLLAGE:-0}
case "$GLYPH_COLLAGE" in
    0|1) ;;
    *) echo "gpu_run.sh: error: REFDML_GPU_GLYPH_COLLAGE == '$GLYPH_COLLAGE', must be 0 or 1 (1: the glyph-collage call)" >&2; exit 2 ;;
esac

REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
PY=${PYTHON:-python3}
LEDGER="$REPO/scripts/gpu_ledger.py"
if [ -n "${OUT:-}" ]; then
    OUTDIR=$OUT
else
    OUTDIR="$REPO/gpu_run_out"
    rm -rf -- "$OUTDIR"
fi
mkdir -p -- "$OUTDIR" || exit 2
OUTDIR=$(cd -- "$OUTDIR" && pwd -P)

# Step names in order; per-step limits in seconds (GPU run, dry run); the whole run's
# budget. A step gets its own limit or what is left after keeping MIN_STEP_S for each later
# step, whichever is smaller, so that a slow step cannot starve the rest to nothing.
STEPS=(install smoke compile parity tests crosscheck bench torch_bench profile train)
# The parity step compiles every kernel into numba-cuda's on-disk cache (.gpu_cache/numba),
# so the test step's workers and the later steps load them instead of compiling again.
declare -A LIMIT_GPU=([install]=60 [smoke]=60 [compile]=60 [parity]=150 [tests]=150
                      [crosscheck]=60 [bench]=170 [torch_bench]=60 [profile]=90 [train]=60)
declare -A LIMIT_DRY=([install]=120 [smoke]=60 [compile]=120 [parity]=90 [tests]=180
                      [crosscheck]=90 [bench]=170 [torch_bench]=60 [profile]=60 [train]=90)
# The glyph-collage call: its step takes what install and smoke leave (they took 3 s and 8 s
# on the H200), and hands the script its limit less 20 s as its own budget (the script's
# default, 450 s; its dry run's 150 s), so that its guard stops it and writes the report
# before `timeout` would.
if (( GLYPH_COLLAGE )); then
    STEPS=(install smoke glyph_collage)
    LIMIT_GPU[glyph_collage]=470
    LIMIT_DRY[glyph_collage]=170
fi
GLYPH_COLLAGE_RESERVE_S=20
# pytest-xdist workers of the test step on a GPU machine (where xdist is installed): the
# GPU test files took 74 s with 8 workers on the H200 and did not finish in 240 s without.
GPU_TEST_WORKERS=8
MIN_STEP_S=20
# 9 minutes less what the ledger, the archive and the summary need after the steps.
BUDGET_S=${REFDML_GPU_RUN_BUDGET_S:-$(( DRY_RUN ? 285 : 525 ))}
TRAIN_EPOCHS=$(( DRY_RUN ? 1 : 5 ))
# A dry run checks that the steps run and that their flags, files and outputs are right,
# on a few cheap cases: Numba's simulator runs one Python thread per CUDA thread, and at
# full size the GPU test files under the CuPy stand-in take over 10 minutes on 2 cores
# (scripts/ci_cupy_standin.sh runs them all). Every name below must exist: a renamed test
# file or case fails the dry run, as it would fail the GPU run.
DRY_PARITY_ONLY=(normalize.l2_normalize losses.contrastive ot.entropic_ot)
DRY_TESTS=(test_gpu_parity_api.py test_gpu_fast_checks.py test_gpu_kernels_losses.py
           test_gpu_normalize_distances.py test_gpu_kernels_retrieval.py)
# The training steps of crosscheck and train take the array path (REFDML_GPU_KERNELS=array,
# as scripts/ci_cupy_standin.sh does): under the simulator the GSP, masked log-sum-exp and
# Sinkhorn kernels take minutes a case, and they run in the tests step.
DRY_KERNELS=(env REFDML_GPU_KERNELS=array)
# Test files of tests/gpu/test_gpu*.py that the GPU run leaves to other steps or to CI: the
# compile check is the compile step; the ledger's test needs no GPU.
NOT_GPU_TESTS=(test_gpu_compile.py test_gpu_ledger.py)

declare -A STATUS EXIT SECS LIMIT_USED REASON COMMAND

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
seconds_between() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# record NAME STATUS EXIT SECONDS LIMIT REASON COMMAND
record() {
    STATUS[$1]=$2 EXIT[$1]=$3 SECS[$1]=$4 LIMIT_USED[$1]=$5
    REASON[$1]=$(printf '%s' "$6" | tr '\t\n' '  ' | cut -c1-300)
    COMMAND[$1]=$(printf '%s' "$7" | tr '\t\n' '  ')
}

# fail_step NAME REASON: a step that did not run, or ran and did not do its job.
fail_step() {
    local name=$1 reason=$2
    if [ -z "${STATUS[$name]:-}" ]; then
        record "$name" failed "" 0 "" "$reason" ""
    else
        STATUS[$name]=failed
        REASON[$name]=$(printf '%s' "${REASON[$name]:+${REASON[$name]}; }$reason" | tr '\t\n' '  ' | cut -c1-300)
    fi
    echo "gpu_run.sh: step $name: FAILED: $reason"
}

skip_step() {
    record "$1" skipped "" 0 "" "$2" ""
    echo "gpu_run.sh: step $1: SKIPPED: $2"
}

# run_step NAME CMD...: CMD from the working folder, under its time limit; output to the
# log and to $RUN/NAME.txt.
run_step() {
    local name=$1 own later=0 seen=0 s left limit start rc secs status reason last
    shift
    if (( DRY_RUN )); then own=${LIMIT_DRY[$name]}; else own=${LIMIT_GPU[$name]}; fi
    for s in "${STEPS[@]}"; do
        if (( seen )); then later=$(( later + MIN_STEP_S )); fi
        [ "$s" = "$name" ] && seen=1
    done
    left=$(awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { printf "%d", d - n }')
    limit=$(( left - later < own ? left - later : own ))
    if (( limit < MIN_STEP_S )); then
        skip_step "$name" "out of time: ${left} s left of the ${BUDGET_S} s budget"
        return 1
    fi
    echo
    echo "=== step $name (limit ${limit} s): $*"
    start=$(now)
    (cd -- "$CWD" && exec timeout --kill-after=15 "$limit" "$@") </dev/null 2>&1 | tee "$RUN/$name.txt"
    rc=${PIPESTATUS[0]}
    secs=$(seconds_between "$start" "$(now)")
    if (( rc == 0 )); then
        status=passed reason=""
    elif (( rc == 124 || rc == 137 )); then
        status=timeout reason="stopped at its ${limit} s limit"
    else
        status=failed
        last=$(grep -v '^[[:space:]]*$' "$RUN/$name.txt" | tail -n 1 | cut -c1-200)
        reason="exit status $rc${last:+: $last}"
    fi
    record "$name" "$status" "$rc" "$secs" "$limit" "$reason" "$*"
    echo "=== step $name: $status in ${secs} s${reason:+ ($reason)}"
    [ "$status" = passed ]
}

# need_file STEP PATH: a missing script fails its step here, as it would on the GPU machine.
need_file() {
    if [ ! -f "$2" ]; then
        fail_step "$1" "missing ${2#"$REPO"/}"
        return 1
    fi
}

# check_junit STEP FILE PREFIX...: the tests must have run, not skipped for these reasons.
check_junit() {
    local name=$1 file=$2 out
    shift 2
    [ "${STATUS[$name]:-}" = passed ] || [ "${STATUS[$name]:-}" = failed ] || return 0
    if ! out=$(env -u PYTHONPATH "$PY" "$LEDGER" --junit "$file" --forbid-skip "$@" 2>&1); then
        echo "$out"
        fail_step "$name" "$(printf '%s\n' "$out" | grep -m1 'PROBLEM\|error' | sed 's/^ *PROBLEM: //')"
        return 1
    fi
    echo "$out"
}

# ------------------------------------------------------------------------ install
# Runs under `timeout` in a child bash, so it is exported with what it reads.
install_wheels() {
    set -uo pipefail
    shopt -s nullglob
    local carried="$REPO/.whl" digest built want found=() others=() wheels=() names key site w
    digest=$(env -u PYTHONPATH "$PY" "$LEDGER" --source-digest "$REPO") \
        || { echo "install: no digest of the sources (scripts/gpu_ledger.py --source-digest)"; return 1; }
    found=("$carried"/refdml-*.whl)
    if (( ${#found[@]} > 1 )); then
        echo "install: more than one refdml wheel in .whl/ (${found[*]##*/}): keep one (bash scripts/gpu_prepare.sh)"
        return 1
    fi
    # The carried wheel only if it was built from these very sources: a wheel older than
    # the tree would test code that is not the code under review.
    want=""
    if (( ${#found[@]} == 1 )) && [ -f "$carried/build_info.json" ]; then
        built=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("source_digest", ""))' \
            "$carried/build_info.json" 2>/dev/null)
        if [ "$built" = "$digest" ]; then
            want=${found[0]}
            cp "$carried/build_info.json" "$RUN/build_info.json"
            echo "refdml wheel: ${want##*/}, built by gpu_prepare.sh from these sources"
        else
            echo "refdml wheel: .whl/${found[0]##*/} was built from other sources (stale); building one here"
        fi
    else
        echo "refdml wheel: none carried with its build_info.json in .whl/; building one here"
    fi
    if [ -z "$want" ]; then
        # A copy of what the wheel is built from, so that the build writes nothing into the
        # repository (build/, *.egg-info).
        rm -rf "$WORK/src" "$WORK/whl"
        mkdir -p "$WORK/src" "$WORK/whl"
        cp -R "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/LICENSE" "$REPO/refdml" "$WORK/src/"
        # Offline first (the GPU machine has no network); a dry run may fetch the build
        # backend when this environment lacks it (setuptools < 70.1 without wheel).
        if ! (cd "$WORK/src" && "$PY" -m pip wheel -q --no-deps --no-index --no-build-isolation . \
                -w "$WORK/whl") > "$RUN/wheel_build.txt" 2>&1; then
            if (( DRY_RUN )); then
                echo "offline build failed ($(grep -m1 -i 'error:' "$RUN/wheel_build.txt")); dry run: building with pip's build isolation (network)"
                (cd "$WORK/src" && "$PY" -m pip wheel -q --no-deps --retries 1 --timeout 20 . -w "$WORK/whl") \
                    || { echo "install: building refdml's wheel failed"; return 1; }
            else
                cat "$RUN/wheel_build.txt"
                echo "install: building refdml's wheel offline failed (pip wheel --no-build-isolation needs setuptools >= 77 for the PEP 639 licence fields, and wheel below 70.1): run scripts/gpu_prepare.sh before the call"
                return 1
            fi
        fi
        want=$(ls "$WORK/whl"/refdml-*.whl 2>/dev/null | head -n 1)
        [ -f "$want" ] || { echo "install: pip wheel wrote no refdml wheel"; return 1; }
        env -u PYTHONPATH "$PY" "$LEDGER" --build-info "$want" --repo "$REPO" --out "$RUN/build_info.json" \
            || { echo "install: build_info.json not written"; return 1; }
        echo "refdml wheel: ${want##*/}, built here"
    fi
    for w in "$carried"/*.whl; do
        [[ ${w##*/} == refdml-* ]] || others+=("$w")
    done
    # Two versions of one package stop the whole install: say which.
    names=$(for w in "${others[@]}"; do
        basename "$w" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'; done | sort | uniq -d)
    if [ -n "$names" ]; then
        echo "install: more than one wheel of: $names in .whl/; keep one version of each"
        return 1
    fi
    if (( DRY_RUN )) && (( ${#others[@]} )); then
        # The carried wheels are for the GPU machine's Python (cp312); here only those this
        # interpreter can install, the environment's own packages standing in for the rest.
        mapfile -t others < <("$PY" - "${others[@]}" <<'PYEOF'
import os, sys
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
supported = set(sys_tags())
for path in sys.argv[1:]:
    if parse_wheel_filename(os.path.basename(path))[3] & supported:
        print(path)
    else:
        print(f"dry run: {os.path.basename(path)} is not for this Python; the environment's "
              "own copy stands in", file=sys.stderr)
PYEOF
        )
    fi
    wheels=("$want" "${others[@]}")
    # The install folder is named by the wheels' hashes and kept: the same wheels reuse it,
    # and with it the paths and file times that Numba's cache index is keyed by.
    key=$(cat "${wheels[@]}" | sha256sum | cut -c1-16)
    site="$SITE_ROOT/site-$key"
    if [ -f "$site/.complete" ]; then
        echo "reusing $site (the same wheels were installed by an earlier call)"
    else
        rm -rf "$SITE_ROOT"/site-*
        mkdir -p "$SITE_ROOT"
        echo "installing ${wheels[*]##*/} into $site"
        rm -rf "$site.partial"
        "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check \
            --target "$site.partial" "${wheels[@]}" || { echo "install: pip install --no-index --target failed"; return 1; }
        mv "$site.partial" "$site" && touch "$site/.complete" || { echo "install: $site not written"; return 1; }
    fi
    printf '%s\n' "$site" > "$RUN/site_path"
    # The installed refdml, not the source tree's, from the working folder of every step.
    local file
    file=$(cd "$CWD" && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import refdml; print(refdml.__file__)') \
        || { echo "install: the installed refdml does not import"; return 1; }
    echo "refdml.__file__ = $file"
    case "$file" in
        "$site"/*) ;;
        *) echo "install: refdml is imported from $file, not from the installed wheel in $site"; return 1 ;;
    esac
}

# ------------------------------------------------------------------------ smoke
write_smoke() {
    cat > "$1" <<'PYEOF'
"""gpu_run.sh's smoke step: versions, the device, numba.cuda.detect(), a Numba kernel on
CuPy arrays and a refdml kernel against its CPU twin. Usage: smoke.py REPORT.json
ENVIRONMENT.txt {gpu,dry-run}. Exit 1 if a check failed."""
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

report_path, environment_path, mode = sys.argv[1:4]
simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
report = {"mode": mode, "simulator": simulated, "cupy_standin": None, "refdml_file": None,
          "compat_steps": None,
          "versions": {"python": platform.python_version()}, "device": {}, "checks": {},
          "lazy_imports": {}, "problems": []}


def problem(what, exc=None):
    text = f"{what}: {type(exc).__name__}: {exc}" if exc is not None else what
    report["problems"].append(text)
    print(f"PROBLEM: {text}")
    if exc is not None:
        traceback.print_exc()


# refdml first, before anything else imports what it must import lazily.
try:
    import refdml
    import refdml.cli
    import refdml.gpu
    import refdml.gradcheck.parity
    import refdml.train
    from refdml.catalog import all_operators

    all_operators()
    refdml.cli.build_parser()
    from refdml.gpu._support import cuda as _cuda

    # refdml's one import of numba.cuda, with what it had to do for this NumPy/numba-cuda
    report["compat_steps"] = list(_cuda.COMPAT_STEPS)
    print(f"numba.cuda compatibility steps: {report['compat_steps'] or 'none needed'}")
    report["refdml_file"] = refdml.__file__
    report["versions"]["refdml"] = refdml.__version__
    print(f"refdml {refdml.__version__} from {refdml.__file__}")
    site = os.environ.get("REFDML_GPU_RUN_SITE", "")
    if not site or not refdml.__file__.startswith(site + os.sep):
        problem(f"refdml is imported from {refdml.__file__}, not from the installed wheel "
                f"({site or 'the install step failed'})")
    for name in ("ot", "dask", "distributed"):
        report["lazy_imports"][name] = name not in sys.modules
        if name in sys.modules:
            problem(f"importing refdml's CLI, fast path, training and catalogue imported {name}, "
                    "which must stay lazy (the GPU machine has no dask, distributed)")
except Exception as exc:
    problem("import refdml", exc)

for key, dist in (("numpy", "numpy"), ("scipy", "scipy"), ("numba", "numba"),
                  ("numba_cuda", "numba-cuda"), ("pot", "POT"), ("torch", "torch"),
                  ("pytest", "pytest"), ("hypothesis", "hypothesis")):
    try:
        report["versions"][key] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        report["versions"][key] = None

try:
    import cupy

    report["versions"]["cupy"] = cupy.__version__
    report["cupy_standin"] = bool(getattr(cupy, "__refdml_standin__", False))
    runtime = cupy.cuda.runtime
    report["device"]["count"] = runtime.getDeviceCount()
    props = runtime.getDeviceProperties(0)
    name = props["name"]
    report["device"].update(
        name=name.decode() if isinstance(name, bytes) else name,
        compute_capability=f"{props['major']}.{props['minor']}",
        memory_bytes=props.get("totalGlobalMem"),
        multiprocessors=props.get("multiProcessorCount"))
    for key, call in (("driver_cuda_version", runtime.driverGetVersion),
                      ("runtime_cuda_version", runtime.runtimeGetVersion)):
        version = call()       # 13000 is CUDA 13.0
        report["device"][key] = f"{version // 1000}.{version % 1000 // 10}"
except Exception as exc:
    problem("CuPy and its device", exc)

smi = shutil.which("nvidia-smi")
if smi:
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        report["device"]["driver_release"] = (done.stdout.strip().splitlines() or [None])[0]
    except (OSError, subprocess.SubprocessError) as exc:
        problem("nvidia-smi", exc)

try:
    from numba import cuda

    report["checks"]["numba_cuda_available"] = bool(cuda.is_available())
    print("numba.cuda.detect():", flush=True)
    detected = cuda.detect()
    report["checks"]["numba_cuda_detect"] = None if detected is None else bool(detected)
    if not simulated:
        report["device"]["numba_runtime_version"] = ".".join(map(str, cuda.runtime.get_version()))
except Exception as exc:
    problem("numba.cuda", exc)

if mode == "gpu":
    if simulated or report["cupy_standin"] or not report["checks"].get("numba_cuda_available"):
        problem("a GPU run with the simulator, the CuPy stand-in or no CUDA device in numba.cuda")
elif not (simulated and report["cupy_standin"]):
    problem("a dry run needs the simulator and the CuPy stand-in")


try:
    from numba import cuda

    # At module level: the simulator swaps the module-global `cuda` for its own at launch.
    @cuda.jit
    def refdml_smoke_axpy(a, x, y, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = a * x[i] + y[i]
except Exception as exc:
    problem("numba.cuda.jit", exc)


def relative_error(got, want):
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-300)


def check(name, run):
    start = time.perf_counter()
    try:
        result = run()
    except Exception as exc:
        report["checks"][name] = {"passed": False, "error": None, "exception": repr(exc)}
        problem(name, exc)
        return
    result["seconds"] = round(time.perf_counter() - start, 4)
    result["passed"] = result["error"] <= result["tolerance"]
    report["checks"][name] = result
    print(f"{name}: max relative error {result['error']:.2e} (tolerance {result['tolerance']:.0e}), "
          f"{'pass' if result['passed'] else 'FAIL'}, {result['seconds']:.2f} s")
    if not result["passed"]:
        problem(f"{name}: error {result['error']:.2e} above {result['tolerance']:.0e}")


def axpy():
    """A Numba kernel on CuPy arrays (NumPy ones under the simulator) against NumPy."""
    import cupy
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(1000), rng.standard_normal(1000)
    blocks = (x.size + 127) // 128
    if simulated:
        got = np.zeros_like(x)
        refdml_smoke_axpy[blocks, 128](2.5, x, y, got)
    else:
        out = cupy.zeros(x.size)
        refdml_smoke_axpy[blocks, 128](2.5, cupy.asarray(x), cupy.asarray(y), out)
        got = cupy.asnumpy(out)
    # One fused multiply-add on the device rounds once where NumPy rounds twice: a few ulps.
    return {"error": relative_error(got, 2.5 * x + y), "tolerance": 1e-14}


def masked_lse(dtype):
    """refdml's masked log-sum-exp: the CUDA kernel on CuPy against its CPU twin on NumPy."""
    def run():
        import cupy
        import numpy as np
        from refdml.gpu import use_kernels
        from refdml.gpu.losses._kernels import masked_logsumexp

        rng = np.random.default_rng(1)
        shape = (8, 16) if simulated else (64, 48)   # the simulator runs a thread per thread
        z = (3 * rng.standard_normal(shape)).astype(dtype)
        mask = rng.random(shape) < 0.6
        with use_kernels("cpu"):
            want = masked_logsumexp(z, mask)
        with use_kernels("cuda"):
            got = masked_logsumexp(cupy.asarray(z), cupy.asarray(mask))
        error = max(relative_error(cupy.asnumpy(g), w) for g, w in zip(got, want))
        # Both sides exponentiate and sum a row in their own order: a few ulps apart.
        return {"error": error, "tolerance": 1e-12 if dtype == "float64" else 1e-5}
    return run


check("numba_axpy", axpy)
check("masked_lse_float64", masked_lse("float64"))
check("masked_lse_float32", masked_lse("float32"))

try:
    done = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze",
                           "--disable-pip-version-check"], capture_output=True, text=True, timeout=60)
    with open(environment_path, "w", encoding="utf-8") as handle:
        handle.write(done.stdout)
except (OSError, subprocess.SubprocessError) as exc:
    problem("pip list", exc)

with open(report_path + ".tmp", "w", encoding="utf-8") as handle:
    json.dump(report, handle, indent=2)
os.replace(report_path + ".tmp", report_path)
print(f"smoke: {len(report['problems'])} problem(s)")
sys.exit(1 if report["problems"] else 0)
PYEOF
}

# ------------------------------------------------------------------------ glyph collage
# glyph_collage_step INSTALLED: scripts/gpu_glyph_collage.py into $RUN/glyph_collage.
glyph_collage_step() {
    local own left limit dry=()
    if (( ! $1 )); then
        skip_step glyph_collage "refdml is not installed (step install)"
        return 1
    fi
    need_file glyph_collage "$REPO/scripts/gpu_glyph_collage.py" || return 1
    (( DRY_RUN )) && dry=(--dry-run)
    # the limit run_step will give it (the last step: its own, or what is left)
    if (( DRY_RUN )); then own=${LIMIT_DRY[glyph_collage]}; else own=${LIMIT_GPU[glyph_collage]}; fi
    left=$(awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { printf "%d", d - n }')
    limit=$(( left < own ? left : own ))
    run_step glyph_collage "$PY" "$REPO/scripts/gpu_glyph_collage.py" "${dry[@]}" \
        --budget-s "$(( limit - GLYPH_COLLAGE_RESERVE_S > 1 ? limit - GLYPH_COLLAGE_RESERVE_S : 1 ))" \
        --out "$RUN/glyph_collage"
}

# ------------------------------------------------------------------------ main
main() {
    local mode=gpu site pytest_extra=()
    (( DRY_RUN )) && mode=dry-run
    START=$(now)
    DEADLINE=$(awk -v s="$START" -v b="$BUDGET_S" 'BEGIN { printf "%.3f", s + b }')
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/refdml-gpu-run.XXXXXX") || exit 2
    RUN="$WORK/run"
    CWD="$WORK/cwd"
    mkdir -p "$RUN" "$CWD"
    trap 'rm -rf -- "$WORK"' EXIT
    CACHE="$REPO/.gpu_cache"
    (( DRY_RUN )) && CACHE="$REPO/.gpu_cache/dry-run"
    SITE_ROOT="$CACHE/install"
    mkdir -p "$CACHE/numba" "$CACHE/cupy"
    echo "gpu_run.sh ($mode): repository $REPO, results in $OUTDIR, working folder $CWD, budget ${BUDGET_S} s"
    echo "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $("$PY" -V 2>&1) at $(command -v "$PY")"

    export NUMBA_ENABLE_CUDASIM=$(( DRY_RUN ))
    # numba-cuda warns on every launch of few blocks; the tests' launches are all small.
    export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
    export NUMBA_CACHE_DIR="$CACHE/numba" CUPY_CACHE_DIR="$CACHE/cupy"
    export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci MPLBACKEND=Agg
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    # POT imports every array library it finds; JAX's would take most of the GPU's memory
    # at its first use and TensorFlow is not needed: POT's torch backend is (bench).
    export POT_BACKEND_DISABLE_JAX=1 POT_BACKEND_DISABLE_TENSORFLOW=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
    if (( DRY_RUN )); then
        export REFDML_CUPY_STANDIN=1
        # tests/conftest.py installs the stand-in in pytest; this does it in every other
        # Python process of the run (gpu-check, bench, train, smoke).
        mkdir -p "$WORK/boot"
        cat > "$WORK/boot/sitecustomize.py" <<PYEOF
import os, sys
if os.environ.get("REFDML_CUPY_STANDIN") == "1":
    sys.path.append("$REPO/tests")
    import cupy_standin
    cupy_standin.install()
PYEOF
    else
        unset REFDML_CUPY_STANDIN
    fi
    # pytest must test the installed refdml: a plugin prints refdml.__file__ once the tests
    # are collected (they import it) and stops the session where it is not the wheel's.
    mkdir -p "$WORK/plugins"
    cat > "$WORK/plugins/refdml_gpu_run_check.py" <<'PYEOF'
"""gpu_run.sh's pytest plugin: the tests import the installed refdml, not the source tree."""
import os
import sys

import pytest


def _where():
    if "refdml" not in sys.modules:
        import refdml  # noqa: F401
    return sys.modules["refdml"].__file__


def pytest_report_collectionfinish(config, start_path, items):
    return f"refdml.__file__ = {_where()}"


def pytest_collection_finish(session):
    path, site = _where(), os.environ.get("REFDML_GPU_RUN_SITE", "")
    if not site or not path.startswith(site + os.sep):
        pytest.exit(f"refdml is imported from {path}, not from the installed wheel "
                    f"({site or 'none installed'})", returncode=4)
PYEOF
    export REPO PY LEDGER WORK RUN CWD SITE_ROOT DRY_RUN
    export -f install_wheels

    # install
    if run_step install bash -c install_wheels; then
        site=$(cat "$RUN/site_path")
        export REFDML_GPU_RUN_SITE="$site" PYTHONPATH="$WORK/plugins:$site${PYTHONPATH:+:$PYTHONPATH}"
        (( DRY_RUN )) && export PYTHONPATH="$WORK/boot:$PYTHONPATH"
    fi
    local installed=0
    [ "${STATUS[install]}" = passed ] && installed=1

    # smoke: runs without the wheel too (versions and the device are worth having)
    write_smoke "$WORK/smoke.py"
    run_step smoke "$PY" "$WORK/smoke.py" "$RUN/smoke.json" "$RUN/environment.txt" "$mode"

    if (( GLYPH_COLLAGE )); then
        glyph_collage_step "$installed"
    elif (( installed )); then
        # numba-cuda compiles for real GPUs only with the simulator off, GPU or not. One
        # architecture (half the time of gpu-check's two): the device's, as the smoke step
        # read it (the default two where it could not); a dry run, the H100's.
        local archs=() cc
        if (( DRY_RUN )); then
            archs=(--arch sm_90)
        else
            cc=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["device"]["compute_capability"].replace(".", ""))' \
                "$RUN/smoke.json" 2>/dev/null) && [[ $cc =~ ^[0-9]+$ ]] && archs=(--arch "sm_$cc")
        fi
        run_step compile env NUMBA_ENABLE_CUDASIM=0 "$PY" -m refdml.cli gpu-check --compile-only \
            "${archs[@]}" --json "$RUN/gpu_check_compile.json"
        if (( DRY_RUN )); then
            run_step parity "$PY" -m refdml.cli gpu-check --dtype float32 float64 \
                --only "${DRY_PARITY_ONLY[@]}" --json "$RUN/gpu_check.json"
        else
            # The GPU's rows only: on a cold machine the NumPy rows' CPU twins took most of
            # the step compiling (100 s and 39 of 240 checks on the H200, 2026-11-28); CI
            # checks them, and the test step runs them too. The GPU's 120 rows took 120 s on
            # a cold H200 (CUDA kernels and CuPy's own kernels compiling), 9 s warm.
            run_step parity "$PY" -m refdml.cli gpu-check --backend cupy --dtype float32 float64 \
                --json "$RUN/gpu_check.json"
        fi

        # pytest from the working folder, on the repository's tests by absolute path: the
        # rootdir and ini are the repository's, the imported refdml is the installed one.
        if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
            pytest_extra+=(--timeout=150)
        fi
        local pytest=("$PY" -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" -p no:cacheprovider
                      -p refdml_gpu_run_check -q -rfEs "${pytest_extra[@]}")
        local gpu_tests=() file ok=1 kernels=()
        if (( DRY_RUN )); then
            for file in "${DRY_TESTS[@]}"; do
                need_file tests "$REPO/tests/gpu/$file" || ok=0
                gpu_tests+=("$REPO/tests/gpu/$file")
            done
            kernels=("${DRY_KERNELS[@]}")
        else
            for file in "$REPO"/tests/gpu/test_gpu*.py; do
                [[ " ${NOT_GPU_TESTS[*]} " == *" ${file##*/} "* ]] || gpu_tests+=("$file")
            done
            # refdml.conformance's CuPy framework on the real CuPy (CI runs it on the stand-in).
            if [[ -f "$REPO/tests/conformance/test_conformance_cupy.py" ]]; then
                gpu_tests+=("$REPO/tests/conformance/test_conformance_cupy.py")
            fi
            # refdml.torch on CUDA tensors: DLPack without a copy, PyTorch's stream.
            if [[ -f "$REPO/tests/interop/test_torch_gpu.py" ]]; then
                gpu_tests+=("$REPO/tests/interop/test_torch_gpu.py")
            fi
            # `refdml reproduce --device cuda`: a glyph task on the real CuPy against the CPU
            # (CI runs it on the stand-in, scripts/ci_cupy_standin.sh).
            if [[ -f "$REPO/tests/reproduce/test_reproduce_studies.py" ]]; then
                gpu_tests+=("$REPO/tests/reproduce/test_reproduce_studies.py::test_a_glyph_task_on_the_device_matches_the_cpu")
            fi
            (( ${#gpu_tests[@]} )) || { fail_step tests "missing tests/gpu/test_gpu*.py"; ok=0; }
        fi
        local parallel=()
        if (( ! DRY_RUN )) && "$PY" -c 'import xdist' 2>/dev/null; then
            parallel=(-n "$GPU_TEST_WORKERS")
        fi
        if (( ok )); then
            run_step tests "${pytest[@]}" "${parallel[@]}" --junitxml "$RUN/junit_gpu_tests.xml" "${gpu_tests[@]}"
            # A test that skips for want of CUDA or CuPy did not test the GPU.
            check_junit tests "$RUN/junit_gpu_tests.xml" requires_cuda requires_cupy
        fi
        if need_file crosscheck "$REPO/tests/train/test_train_crosscheck.py"; then
            run_step crosscheck "${kernels[@]}" "${pytest[@]}" --junitxml "$RUN/junit_train_crosscheck.xml" \
                "$REPO/tests/train/test_train_crosscheck.py" -k trajectories
            check_junit crosscheck "$RUN/junit_train_crosscheck.xml" '*'
        fi
        if need_file bench "$REPO/scripts/bench_gpu.py"; then
            # --capture: the train section also times the step replayed as a CUDA graph
            # (TrainingLoop(capture=True)) beside the uncaptured step and PyTorch's; the dry
            # run takes the flag too (its captured row says why it is not run there).
            if (( DRY_RUN )); then
                run_step bench "$PY" "$REPO/scripts/bench_gpu.py" --device cuda --capture --dry-run --json "$RUN/bench_gpu.json"
            else
                run_step bench "$PY" "$REPO/scripts/bench_gpu.py" --device cuda --capture --json "$RUN/bench_gpu.json"
            fi
        fi
        # GSPPool against the authors' layer on CUDA tensors (the dry run: torch's CPU at
        # --quick sizes, where torch is installed; a skip with its reason where it is not).
        if need_file torch_bench "$REPO/scripts/bench_torch_gsp.py"; then
            if (( DRY_RUN )); then
                run_step torch_bench "$PY" "$REPO/scripts/bench_torch_gsp.py" --quick --json "$RUN/bench_torch_gsp.json"
            else
                run_step torch_bench "$PY" "$REPO/scripts/bench_torch_gsp.py" --device cuda --repeats 10 --json "$RUN/bench_torch_gsp.json"
            fi
        fi
        if need_file profile "$REPO/scripts/gpu_profile.py"; then
            if (( DRY_RUN )); then
                run_step profile "$PY" "$REPO/scripts/gpu_profile.py" --dry-run --json "$RUN/gpu_profile.json"
            else
                run_step profile "$PY" "$REPO/scripts/gpu_profile.py" --json "$RUN/gpu_profile.json"
            fi
        fi
        local train_config=()
        if (( DRY_RUN )); then
            # The study's model and objective at toy size.
            cat > "$WORK/train_dry_run.toml" <<'TOMLEOF'
n_classes = 4
n_classes_per_batch = 4
n_train_per_class = 8
n_val_per_class = 4
n_test_per_class = 4
n_prototypes = 3
dim = 4
embedding_dim = 4
TOMLEOF
            train_config=(--config "$WORK/train_dry_run.toml")
        fi
        run_step train "${kernels[@]}" "$PY" -m refdml.cli train --study tokens "${train_config[@]}" --device cuda \
            --epochs "$TRAIN_EPOCHS" --seed 0 --out "$RUN/train_tokens" --no-progress
    else
        local s
        for s in compile parity tests crosscheck bench torch_bench profile train; do
            skip_step "$s" "refdml is not installed (step install)"
        done
    fi

    # --------------------------------------------------------------- results
    local name
    for name in "${STEPS[@]}"; do
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "${STATUS[$name]}" "${EXIT[$name]}" \
            "${SECS[$name]}" "${LIMIT_USED[$name]}" "${REASON[$name]}" "${COMMAND[$name]}"
    done > "$RUN/steps.tsv"
    local ledger_ok=1 dry_flag=()
    (( DRY_RUN )) && dry_flag=(--dry-run)
    echo
    env -u PYTHONPATH "$PY" "$LEDGER" --assemble "$RUN" --steps "$RUN/steps.tsv" \
        --out "$OUTDIR/gpu_ledger.json" "${dry_flag[@]}" || ledger_ok=0
    [ -f "$RUN/compile.txt" ] && cp "$RUN/compile.txt" "$OUTDIR/gpu_check_compile.txt"
    [ -f "$RUN/parity.txt" ] && cp "$RUN/parity.txt" "$OUTDIR/gpu_check.txt"
    for name in junit_gpu_tests.xml junit_train_crosscheck.xml; do
        [ -f "$RUN/$name" ] && cp "$RUN/$name" "$OUTDIR/$name"
    done
    [ -f "$RUN/glyph_collage/glyph_collage.json" ] && cp "$RUN/glyph_collage/glyph_collage.json" "$OUTDIR/"
    [ -f "$RUN/glyph_collage/README.md" ] && cp "$RUN/glyph_collage/README.md" "$OUTDIR/glyph_collage_README.md"
    # Everything else in one archive (seven files in all; see the top); the training
    # checkpoints are left out (large, and rebuilt by any rerun).
    tar -czf "$OUTDIR/gpu_run_files.tar.gz" -C "$WORK" --exclude='*.npz' run 2>/dev/null || ledger_ok=0

    echo
    echo "gpu_run.sh ($mode) summary"
    printf '%-11s %-8s %8s %7s  %s\n' step status seconds limit note
    local failed=0
    for name in "${STEPS[@]}"; do
        printf '%-11s %-8s %8s %7s  %s\n' "$name" "${STATUS[$name]}" "${SECS[$name]}" \
            "${LIMIT_USED[$name]:--}" "${REASON[$name]}"
        [ "${STATUS[$name]}" = passed ] || failed=1
    done
    (( ledger_ok )) || { echo "the ledger or the archive could not be written"; failed=1; }
    echo "total $(seconds_between "$START" "$(now)") s; results in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
    if (( $(ls -1 "$OUTDIR" | wc -l) > 8 )); then
        echo "note: more than 8 files in $OUTDIR: a GPU host may return only 8"
    fi
    return "$failed"
}

main 2>&1 | tee "$OUTDIR/gpu_run.log"
exit "${PIPESTATUS[0]}"
