#!/usr/bin/env bash
# CI leg (issue 38): the release packaging, as a user of the wheel would meet it.
#
#   bash scripts/ci_package.sh
#
# 1. A fresh venv with the tools of the `release` extra (build, twine; read from pyproject.toml).
# 2. `python -m build` writes the sdist and the wheel from a copy of the working tree (tracked
#    and untracked files git does not ignore; nothing is written into the tree).
# 3. `twine check --strict` on both; the wheel must hold LICENSE, its metadata the licence
#    expression, the classifiers and no extra's package among the core requirements; the
#    sdist must hold LICENSE, README.md and pyproject.toml.
# 4. A second fresh venv installs the WHEEL only (the core, no extra), and, outside the
#    repository: `refdml --version` equals the installed metadata; the main command's smoke
#    (`refdml verify --quick --only` two cheap claims) passes; `refdml reproduce --quick`
#    exits 2 with one line naming refdml[reproduce], no traceback.
#
# Exit status: 0 all passed; 1 a step failed (the step is named on stderr).
# Environment: PYTHON (default python3), KEEP=1 keeps the work folder.

set -uo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/refdml-package.XXXXXX")
if [ "${KEEP:-0}" != 1 ]; then
    trap 'rm -rf -- "$WORK"' EXIT
fi
start=$SECONDS

# pip, less the lines where a configured local index lacks a package (noise here).
pip_() {
    "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}

fail() {
    echo "ci_package.sh: FAILED: $*" >&2
    exit 1
}

echo "== the release tools (the release extra of pyproject.toml), in a fresh venv"
tools=$("$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as handle:
    print(" ".join(tomllib.load(handle)["project"]["optional-dependencies"]["release"]))
PYEOF
) || fail "reading the release extra from pyproject.toml (Python 3.11+, or tomli)"
"$PY" -m venv "$WORK/tools" || fail "python -m venv"
# shellcheck disable=SC2086  # one word per requirement
pip_ "$WORK/tools/bin/pip" install -q $tools || fail "pip install $tools"

echo "== python -m build (sdist and wheel) from a copy of the working tree"
mkdir -p "$WORK/src"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$WORK/src" \
    || fail "copying the working tree"
"$WORK/tools/bin/python" -m build -q --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; fail "python -m build"; }
sdist=$(ls "$WORK"/dist/refdml-*.tar.gz 2>/dev/null)
wheel=$(ls "$WORK"/dist/refdml-*.whl 2>/dev/null)
[ -n "$sdist" ] && [ -n "$wheel" ] || fail "python -m build wrote no sdist or no wheel: $(ls "$WORK/dist")"
echo "built ${sdist##*/} ($(du -h "$sdist" | cut -f1)) and ${wheel##*/} ($(du -h "$wheel" | cut -f1))"

echo "== twine check --strict"
"$WORK/tools/bin/twine" check --strict "$sdist" "$wheel" || fail "twine check --strict"

echo "== the archives' contents and metadata"
"$WORK/tools/bin/python" - "$sdist" "$wheel" <<'PYEOF' || fail "the archives' contents or metadata"
import re
import sys
import tarfile
import zipfile
from email.parser import Parser

sdist, wheel = sys.argv[1:]
problems = []
with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(archive.read(meta_name).decode())
if not any(re.search(r"\.dist-info/licenses/LICENSE$", n) for n in names):
    problems.append("the wheel holds no .dist-info/licenses/LICENSE")
if meta.get("License-Expression") != "BSD-3-Clause":
    problems.append(f"License-Expression is {meta.get('License-Expression')!r}, not 'BSD-3-Clause'")
classifiers = meta.get_all("Classifier") or []
for wanted in ("Intended Audience :: Science/Research",
               "Topic :: Scientific/Engineering :: Mathematics"):
    if wanted not in classifiers:
        problems.append(f"classifier {wanted!r} missing")
if any(c.startswith("License ::") for c in classifiers):
    problems.append("a 'License ::' classifier beside License-Expression (PEP 639 forbids it)")
core = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
for heavy in ("distributed", "scikit-learn", "matplotlib", "dask"):
    if any(re.match(rf"{heavy}\b", r, re.I) for r in core):
        problems.append(f"{heavy} is a core requirement (it belongs to an extra)")
for extra in ("plot", "train", "reproduce", "gpu", "test", "docs", "release"):
    if extra not in (meta.get_all("Provides-Extra") or []):
        problems.append(f"extra {extra!r} not provided")
print(f"wheel: {len(names)} files, Metadata-Version {meta['Metadata-Version']}, "
      f"{len(classifiers)} classifiers, {len(core)} core requirements")
with tarfile.open(sdist) as archive:
    members = {m.name.split("/", 1)[-1] for m in archive.getmembers()}
for wanted in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO", "refdml/__init__.py"):
    if wanted not in members:
        problems.append(f"the sdist holds no {wanted}")
print(f"sdist: {len(members)} entries")
if problems:
    sys.exit("\n".join(problems))
PYEOF

echo "== the wheel alone (core, no extra) in a fresh venv"
"$PY" -m venv "$WORK/user" || fail "python -m venv"
pip_ "$WORK/user/bin/pip" install -q "$wheel" || fail "pip install the wheel"
for absent in distributed sklearn matplotlib; do
    if "$WORK/user/bin/python" -c "import $absent" 2>/dev/null; then
        fail "the core install brought $absent (an extra's package)"
    fi
done
cd "$WORK" || fail "cd $WORK"  # outside the repository: the installed refdml, not the sources
version=$("$WORK/user/bin/refdml" --version) || fail "refdml --version"
metadata=$("$WORK/user/bin/python" -c 'import importlib.metadata as m; print("refdml", m.version("refdml"))')
[ "$version" = "$metadata" ] || fail "refdml --version says '$version', the metadata '$metadata'"
echo "refdml --version: $version (== the installed metadata)"
"$WORK/user/bin/python" -c 'import refdml, sys; assert refdml.__file__.startswith(sys.prefix), refdml.__file__' \
    || fail "refdml is not imported from the venv"

echo "== the main command's smoke: refdml verify --quick --only gsp.prop4.2 asap.eq4.2"
"$WORK/user/bin/refdml" verify --quick --only gsp.prop4.2 asap.eq4.2 || fail "refdml verify (smoke)"

echo "== a missing extra: refdml reproduce --quick"
"$WORK/user/bin/refdml" reproduce --quick >"$WORK/out" 2>"$WORK/err"
code=$?
cat "$WORK/err"
[ "$code" -eq 2 ] || fail "refdml reproduce --quick exited $code, not 2"
[ "$(wc -l <"$WORK/err")" -eq 1 ] || fail "refdml reproduce --quick: stderr is not one line"
grep -q 'pip install "refdml\[reproduce\]"' "$WORK/err" || fail "the line does not name refdml[reproduce]"
[ ! -s "$WORK/out" ] || fail "refdml reproduce --quick printed on stdout before stopping"

echo "ci_package.sh: passed in $((SECONDS - start)) s"
