#!/usr/bin/env bash
# The exactness-sensitive tests (pytest -m cpu_exact: retrieval, k-center, metrics, the
# compiled CPU twins, the OT pair route) again under each CPU code path this machine can run,
# so that a result or an assertion that holds only on the CI machine's CPU fails here:
#
#   openblas-<kernel>  OPENBLAS_CORETYPE = Prescott (any x86_64), Sandybridge (avx),
#                      Haswell (avx2 + fma), SkylakeX (avx512f/bw/vl/dq/cd)
#   generic            a CPU without AVX2 or FMA for everything but BLAS:
#                      NUMBA_CPU_NAME=generic (Numba's portable target: no AVX, no FMA),
#                      NPY_DISABLE_CPU_FEATURES = NumPy's dispatched SIMD targets (NumPy's
#                      float64 exp/log/power differ in the last bit on AVX-512), and
#                      glibc's libm without its FMA/AVX2 variants (GLIBC_TUNABLES: exp and
#                      log, as NumPy and Numba call them, differ in the last bit)
#
# The legs also vary the thread counts (Numba 1 or 2, OpenBLAS 1 or 2). The CUDA-simulator
# tests are left out (-k "not cuda": the simulator runs no compiled CPU code; the README's
# test command runs them). Hypothesis draws fewer examples (profile "cpu_matrix",
# tests/conftest.py) where a test does not fix its own count.
#
# Usage: bash scripts/ci_cpu_matrix.sh [extra pytest arguments], in the environment that
# runs the tests (the `pytest` command, as the README's: `python -m pytest` would put the
# repository's refdml/ ahead of a non-editable install, without refdml.gpu). Prints a
# table; exits 1 if any leg fails.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
pytest=${PYTEST:-pytest}

legs=()    # "name|environment (space-separated VAR=value)"
machine=$(uname -m)
if [ "$machine" = x86_64 ]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
    has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
    legs+=("openblas-Prescott|OPENBLAS_CORETYPE=Prescott NUMBA_NUM_THREADS=1")
    has avx && legs+=("openblas-Sandybridge|OPENBLAS_CORETYPE=Sandybridge NUMBA_NUM_THREADS=2")
    has avx2 fma && legs+=("openblas-Haswell|OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=2")
    has avx512f avx512bw avx512vl avx512dq avx512cd \
        && legs+=("openblas-SkylakeX|OPENBLAS_CORETYPE=SkylakeX NUMBA_NUM_THREADS=1")
else
    echo "ci_cpu_matrix: $machine is not x86_64: OpenBLAS's x86 kernels cannot be chosen here;"
    echo "ci_cpu_matrix: running the generic leg only"
fi
# NumPy's runtime-dispatched SIMD targets found on this CPU (a private module; none if moved).
simd=$("$python" - <<'EOF' 2>/dev/null
try:
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
except ImportError:
    from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
print(" ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f)))
EOF
)
generic="NUMBA_CPU_NAME=generic GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA"
[ -n "$simd" ] && generic="$generic NPY_DISABLE_CPU_FEATURES=${simd// /,}"
legs+=("generic|$generic")

log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
rows=()
failed_legs=0 total_passed=0 total_failed=0
start_all=$SECONDS
for leg in "${legs[@]}"; do
    name=${leg%%|*}
    envs=${leg#*|}
    echo "=== ci_cpu_matrix: $name ($envs)"
    start=$SECONDS
    # shellcheck disable=SC2086  # envs: VAR=value words (lists comma-separated, no spaces)
    env HYPOTHESIS_PROFILE=cpu_matrix $envs \
        "$pytest" -q -p no:cacheprovider -m cpu_exact -k "not cuda" "$@" \
        >"$log/$name.txt" 2>&1
    status=$?
    seconds=$((SECONDS - start))
    summary=$(tail -n 1 "$log/$name.txt")
    passed=0 failures=0
    for count in $(grep -Eo '[0-9]+ passed' <<<"$summary" | grep -Eo '^[0-9]+'); do
        passed=$((passed + count))
    done
    for count in $(grep -Eo '[0-9]+ (failed|errors?)' <<<"$summary" | grep -Eo '^[0-9]+'); do
        failures=$((failures + count))
    done
    total_passed=$((total_passed + passed))
    total_failed=$((total_failed + failures))
    if [ "$status" -eq 0 ]; then
        result=ok
        tail -n 1 "$log/$name.txt"
    else
        # 5: no test collected (a broken marker or selection), a failure too
        result="FAILED (pytest exit $status)"
        failed_legs=$((failed_legs + 1))
        [ "$failures" -eq 0 ] && total_failed=$((total_failed + 1))
        cat "$log/$name.txt"
    fi
    rows+=("$(printf '%-20s %-22s %5ss  %s' "$name" "$result" "$seconds" "$summary")|$envs")
done

echo
echo "ci_cpu_matrix: pytest -m cpu_exact under each CPU code path ($((SECONDS - start_all)) s)"
printf '%-20s %-22s %6s  %s\n' leg result time "pytest summary"
for row in "${rows[@]}"; do
    echo "${row%%|*}"
    echo "    env: ${row#*|}"
done
if [ "$failed_legs" -ne 0 ]; then
    echo "ci_cpu_matrix: $failed_legs leg(s) failed: a result or an exact assertion depends on the CPU"
    echo "matrix: $total_passed passed, $total_failed failed"
    exit 1
fi
echo "matrix: $total_passed passed, $total_failed failed"
