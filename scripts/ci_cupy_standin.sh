#!/usr/bin/env bash
# refdml's CuPy paths under CuPy's rules, without a GPU (issue 21; docs/gpu/without-a-gpu.md,
# "The CuPy stand-in"). REFDML_CUPY_STANDIN=1 makes tests/conftest.py install tests/cupy_standin as
# the module `cupy` (with cupy.cuda, cupyx, cupyx.scipy.special/linalg) before anything
# imports refdml: a NumPy-backed array that refuses implicit conversion to NumPy as CuPy
# does (and np.* functions, which CuPy would dispatch) and counts every host transfer.
# NUMBA_ENABLE_CUDASIM=1 runs the @cuda.jit kernels under Numba's simulator on the
# stand-in's memory (refdml.gpu._support.launch.cuda_launch hands them host views).
#
# Steps (each with its exit status; the script exits 1 if any fails):
#   standin    the stand-in's own tests, the synchronisation counts of the operators, their
#              launch and synchronisation ceilings (tests/gpu/test_gpu_launch_counts.py), and
#              the CuPy rows of the parity suite, the kernel tests' CUDA rows, the fast
#              checks, the optimiser, the captured training step's capture-safety
#              (tests/train/test_train_capture.py) and `refdml gpu-check` (in-process:
#              tests/cli/test_cli.py)
#   crosscheck the CPU vs "GPU" training trajectories (tests/train/test_train_crosscheck.py) on the
#              stand-in, array path (REFDML_GPU_KERNELS=array: the simulated kernels would
#              take minutes; the kernels' own rows run in "standin")
#   reproduce  a `refdml reproduce` glyph task with device "cuda" against the CPU's metrics
#   train      `refdml train --study tokens --device cuda` for one epoch of a small config,
#              in-process (the stand-in must be installed in the process that runs it)
#
# Hypothesis draws the "cpu_matrix" profile's 10 fixed examples where a test does not fix
# its own count (tests/conftest.py). Usage: bash scripts/ci_cupy_standin.sh [extra pytest
# arguments for the "standin" step], in the environment that runs the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
pytest=${PYTEST:-pytest}

export REFDML_CUPY_STANDIN=1 NUMBA_ENABLE_CUDASIM=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-cpu_matrix}

names=() statuses=() seconds=()
step() {   # step NAME COMMAND...
    local name=$1 start=$SECONDS status
    shift
    echo "=== ci_cupy_standin: $name"
    "$@"
    status=$?
    names+=("$name") statuses+=("$status") seconds+=("$((SECONDS - start))")
}

step standin "$pytest" -q -p no:cacheprovider \
    tests/gpu/test_cupy_standin.py tests/gpu/test_gpu_sync_counts.py tests/gpu/test_gpu_launch_counts.py \
    tests/gpu/test_gpu_fast_checks.py \
    tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_parity_api.py tests/gpu/test_gpu_kernels_gsp.py \
    tests/gpu/test_gpu_kernels_kcenter.py tests/gpu/test_gpu_kernels_losses.py \
    tests/gpu/test_gpu_kernels_ot.py tests/gpu/test_gpu_kernels_retrieval.py tests/train/test_train_optim.py \
    tests/train/test_train_capture.py tests/cli/test_cli.py \
    -k "standin or sync or cupy or cuda or gpu_check or parity_api" "$@"

step crosscheck env REFDML_GPU_KERNELS=array "$pytest" -q -p no:cacheprovider \
    tests/train/test_train_crosscheck.py -k trajectories

# `refdml reproduce --device cuda`: a glyph task (GSP head) on the device against the CPU's.
step reproduce env REFDML_GPU_KERNELS=array "$pytest" -q -p no:cacheprovider \
    tests/reproduce/test_reproduce_studies.py -k device

train_dir=$(mktemp -d)
trap 'rm -rf "$train_dir"' EXIT
printf '%s\n' 'n_classes = 4' 'n_classes_per_batch = 4' 'n_train_per_class = 8' \
    'n_val_per_class = 4' 'n_test_per_class = 4' 'head = "gsp"' 'n_prototypes = 3' \
    'dim = 4' 'embedding_dim = 4' > "$train_dir/run.toml"
# From the temporary folder, not the repository root: there the source refdml/ would shadow
# the installed package under test.
step train env -C "$train_dir" REFDML_GPU_KERNELS=array "$python" - "$train_dir" "$PWD/tests" <<'EOF'
import sys
sys.path.insert(0, sys.argv[2])
import cupy_standin

cupy_standin.install()
from refdml.cli import main

out = sys.argv[1]
code = main(["train", "--study", "tokens", "--config", f"{out}/run.toml", "--out", f"{out}/run",
             "--no-progress", "--seed", "0", "--epochs", "1", "--device", "cuda"])
sys.exit(code)
EOF

echo
printf '%-12s %-8s %s\n' step result seconds
failed=0
for i in "${!names[@]}"; do
    result=pass
    [ "${statuses[$i]}" -eq 0 ] || { result="FAIL(${statuses[$i]})"; failed=1; }
    printf '%-12s %-8s %s\n' "${names[$i]}" "$result" "${seconds[$i]}"
done
exit $failed
