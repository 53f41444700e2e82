#!/usr/bin/env bash
# CI's leg on the newest stack: refdml on Python 3.12 and 3.13 with the newest NumPy, numba
# and numba-cuda the index has (docs/gpu/compiler.md, "The CUDA compiler on today's stack").
# CI's main leg runs Python 3.11, where NumPy stops at 2.4; NumPy 2.5 (Python >= 3.12) broke every
# CUDA kernel through numba-cuda, and only a GPU run noticed.
#
# For each Python (found as pythonX.Y on PATH, else under `pyenv root`), in a fresh venv
# .venv-newest-X.Y (ignored by git): pip install ".[test,gpu]" with --upgrade-strategy eager
# (the newest release of every dependency), then
#   compile   refdml gpu-check --compile-only --arch sm_80 sm_90 (no GPU needed)
#   tests     the import point of numba.cuda, the compile registry and cache keys, the launch
#             seam, the architecture rules, and the GSP kernel cases the H200 failed, under
#             Numba's CUDA simulator
#   standin   the stand-in's own tests and the CuPy rows of those GSP cases on the CuPy
#             stand-in (float32 flush-to-zero as CuPy's kernels)
#
# Usage: bash scripts/ci_newest_stack.sh [X.Y ...]   (default: 3.12 3.13). A Python this
# machine lacks is reported and skipped; exit 1 if none was found or any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-cpu_matrix}

versions=("$@")
(( ${#versions[@]} )) || versions=(3.12 3.13)

find_python() {   # find_python X.Y: a path of a Python X.Y that runs, or nothing
    local v=$1 root candidate
    root=$(pyenv root 2>/dev/null) || root=${PYENV_ROOT:-$HOME/.pyenv}
    # (a pyenv shim named pythonX.Y exists even where that version is not selected: ask it)
    for candidate in "$(command -v "python$v" 2>/dev/null)" "$root"/versions/"$v".*/bin/python; do
        if [ -x "$candidate" ] && "$candidate" -c "import sys; assert sys.version.startswith('$v.')" \
                >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
}

names=() statuses=() seconds=() found=0
step() {   # step NAME COMMAND...
    local name=$1 start=$SECONDS status
    shift
    echo "=== ci_newest_stack: $name"
    "$@"
    status=$?
    names+=("$name") statuses+=("$status") seconds+=("$((SECONDS - start))")
}

# The H200's six GSP failures, the low-occupancy filter and the contraction model (simulator).
GSP_CASES="near_its_largest or huge_inverse_temperature or fma_contraction or low_occupancy"

for v in "${versions[@]}"; do
    py=$(find_python "$v")
    if [ -z "$py" ]; then
        echo "ci_newest_stack: no Python $v on this machine: skipped"
        continue
    fi
    found=$((found + 1))
    venv=".venv-newest-$v"
    step "install $v" bash -c "rm -rf '$venv' && '$py' -m venv '$venv' && \
        '$venv/bin/pip' install -q --upgrade --upgrade-strategy eager '.[test,gpu]' && \
        '$venv/bin/python' -c 'import sys, numpy, numba, importlib.metadata as m; \
print(\"Python\", sys.version.split()[0], \"NumPy\", numpy.__version__, \"numba\", numba.__version__, \
\"numba-cuda\", m.version(\"numba-cuda\"))'"
    if [ "${statuses[-1]}" -ne 0 ]; then
        continue
    fi
    # From a folder outside the checkout: its refdml/ would shadow the install under test.
    step "compile $v" bash -c "cd \"\$(mktemp -d)\" && NUMBA_ENABLE_CUDASIM=0 \
        '$PWD/$venv/bin/refdml' gpu-check --compile-only --arch sm_80 sm_90"
    step "tests $v" env NUMBA_ENABLE_CUDASIM=1 "$venv/bin/pytest" -q -p no:cacheprovider \
        tests/base/test_cuda_import_point.py tests/gpu/test_gpu_compile.py \
        tests/gpu/test_cuda_launch.py tests/gpu/test_contraction_model.py \
        tests/test_architecture.py tests/gpu/test_gpu_kernels_gsp.py \
        --deselect tests/gpu/test_gpu_compile.py::test_every_kernel_compiles_for_sm80_and_sm90_without_spills \
        -k "not test_gpu_kernels_gsp or $GSP_CASES"
    step "standin $v" env REFDML_CUPY_STANDIN=1 NUMBA_ENABLE_CUDASIM=1 "$venv/bin/pytest" -q \
        -p no:cacheprovider tests/gpu/test_cupy_standin.py tests/gpu/test_gpu_kernels_gsp.py \
        -k "not test_gpu_kernels_gsp or near_its_largest or huge_inverse_temperature"
done

echo
echo "ci_newest_stack summary"
failed=0
for i in "${!names[@]}"; do
    printf '%-16s %s (%s s)\n' "${names[$i]}" \
        "$([ "${statuses[$i]}" -eq 0 ] && echo passed || echo "FAILED (${statuses[$i]})")" "${seconds[$i]}"
    [ "${statuses[$i]}" -eq 0 ] || failed=1
done
if (( found == 0 )); then
    echo "ci_newest_stack: none of Python ${versions[*]} is on this machine" >&2
    exit 1
fi
exit "$failed"
