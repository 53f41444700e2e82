#!/usr/bin/env bash
# Before a GPU call (issue 21; docs/gpu/gpu-machine.md, "Running on a GPU machine"): run here, with
# network, from anywhere in the repository.
#
#   bash scripts/gpu_prepare.sh
#
# Writes into .whl/ (ignored; carried to the GPU machine, where scripts/gpu_run.sh installs
# it with pip --no-index): refdml's wheel (pip wheel --no-deps) with build_info.json (the
# wheel's hash, the digest of its sources, the git commit), and the wheels the GPU machine
# lacks, for its CPython 3.12 on manylinux x86_64: POT (the same version as here when this
# environment has it; POT_SPEC=POT==X.Y overrides). Then it checks every carried wheel's
# requirements against the GPU machine's packages, and prints what travels.
#
# Exit status: 0 ready; 1 a build, a download or a check failed.

set -euo pipefail

REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
cd -- "$REPO"
PY=${PYTHON:-python3}
WHL="$REPO/.whl"
# Everything that travels to the GPU machine (the working tree and .whl/) must stay under
# 64 MiB; this leaves room for edits made after preparing.
MAX_TRAVEL_MIB=56

if ! git check-ignore -q .whl/; then
    echo "gpu_prepare.sh: .whl/ is not ignored by git (add /.whl/ to .gitignore): it would travel twice" >&2
    exit 1
fi
mkdir -p "$WHL"

# One version of each package: two stop the install there. A rebuild replaces refdml's.
echo "== refdml wheel"
rm -f "$WHL"/refdml-*.whl "$WHL"/build_info.json
build=$(mktemp -d "${TMPDIR:-/tmp}/refdml-wheel.XXXXXX")
trap 'rm -rf -- "$build"' EXIT
# A copy of what the wheel is built from, so that the build writes nothing (build/,
# *.egg-info) into a tree other people are editing.
cp -R pyproject.toml README.md LICENSE refdml "$build/"
find "$build" -name __pycache__ -type d -prune -exec rm -rf {} +
(cd "$build" && "$PY" -m pip wheel -q --no-deps . -w "$build/dist")
wheel=$(ls "$build"/dist/refdml-*.whl)
cp "$wheel" "$WHL/"
wheel="$WHL/${wheel##*/}"
"$PY" scripts/gpu_ledger.py --build-info "$wheel" --repo "$REPO" --out "$WHL/build_info.json"
echo "built ${wheel##*/}"

echo "== wheels for the GPU machine (CPython 3.12, manylinux x86_64)"
if [ -z "${POT_SPEC:-}" ]; then
    here=$("$PY" -c 'import importlib.metadata as m; print(m.version("POT"))' 2>/dev/null || true)
    POT_SPEC="POT${here:+==$here}"
fi
# pip matches each manylinux tag exactly: the glibc versions POT's wheels are built for.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
pot_have=$(ls "$WHL"/[pP][oO][tT]-*.whl 2>/dev/null || true)
pot_version=${POT_SPEC#*==}
if [ -n "$pot_have" ] && [ "$pot_version" != "$POT_SPEC" ] && [ "$(echo "$pot_have" | wc -l)" -eq 1 ] \
        && [[ "${pot_have##*/}" == [pP][oO][tT]-"$pot_version"-* ]]; then
    echo "already there: ${pot_have##*/}"
else
    rm -f "$WHL"/[pP][oO][tT]-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 "${platforms[@]}" -d "$WHL" "$POT_SPEC"
    echo "downloaded $(cd "$WHL" && ls [pP][oO][tT]-*.whl)"
fi

echo "== requirements of the carried wheels against the GPU machine's packages"
"$PY" - "$WHL" <<'PYEOF'
"""Each carried wheel's Requires-Dist (markers evaluated for CPython 3.12 on Linux; refdml's
with the extras the GPU run uses, EXTRAS, other wheels' extras left out) must be on the GPU
machine, carried, or imported lazily by refdml."""
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

# The GPU machine's image, as this workplace's notes on it list its Python packages
# (read 2026-11-17; nothing can be installed there from the network).
GPU_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()
# Needed only by `refdml reproduce`'s Dask runner, which imports them inside the function
# that runs the grid (checked on the GPU machine by gpu_run.sh's smoke step; the GPU run
# calls the studies in process): not carried.
LAZY = {"dask", "distributed"}
# refdml's extras that gpu_run.sh uses: it trains (train), reproduces (reproduce) and draws
# figures (plot). gpu_run.sh installs the wheels with --no-deps, so these extras' packages
# must be on the GPU machine or carried like the core's.
EXTRAS = ("", "train", "reproduce", "plot")
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "extra": ""}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
image = {norm(n) for n in GPU_IMAGE}
carried = {}
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        carried[wheel] = Parser().parsestr(archive.read(meta).decode())
names = {norm(m["Name"]) for m in carried.values()}
problems = 0
for wheel, meta in carried.items():
    extras = EXTRAS if norm(meta["Name"]) == "refdml" else ("",)
    for text in meta.get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({**ENVIRONMENT, "extra": e})
                                              for e in extras):
            continue
        name = norm(req.name)
        where = ("on the GPU machine" if name in image else "carried" if name in names
                 else "not carried: imported lazily" if name in LAZY else None)
        print(f"  {wheel.name.split('-')[0]} needs {req}: {where or 'MISSING'}")
        problems += where is None
if problems:
    sys.exit(f"{problems} requirement(s) neither on the GPU machine nor carried: download "
             "them into .whl/ too (pip download --no-deps ...)")
PYEOF

echo "== what travels to the GPU machine"
"$PY" - "$REPO" "$MAX_TRAVEL_MIB" <<'PYEOF'
import os
import subprocess
import sys

repo, limit = sys.argv[1], float(sys.argv[2])
listed = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others",
                         "--exclude-standard"], capture_output=True, check=True).stdout
tree = sum(os.path.getsize(os.path.join(repo, p)) for p in listed.decode().split("\0")
           if p and os.path.isfile(os.path.join(repo, p)))
whl_dir = os.path.join(repo, ".whl")
carried = {n: os.path.getsize(os.path.join(whl_dir, n)) for n in sorted(os.listdir(whl_dir))}
mib = 1 << 20
for name, size in carried.items():
    print(f"  .whl/{name}: {size / mib:.1f} MiB")
total = tree + sum(carried.values())
print(f"  working tree (tracked and untracked, not ignored): {tree / mib:.1f} MiB")
print(f"  total: {total / mib:.1f} MiB of the 64 MiB a call may carry (this script's limit {limit:g} MiB)")
if total > limit * mib:
    sys.exit(f"gpu_prepare.sh: {total / mib:.1f} MiB would travel, over {limit:g} MiB")
PYEOF

echo "ready: carry .whl/ to the GPU machine and run 'bash scripts/gpu_run.sh' there, from the repository root"
