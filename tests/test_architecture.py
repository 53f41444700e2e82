"""The import contract: refdml's layers, and that dependencies run one way between them.

An AST walk over every module of the source folder ``refdml/`` (the fast path ``refdml/gpu/`` and
``refdml verify``'s ``refdml/validation/`` included) collects every import,
module-level and function-local alike (an import inside a function is still a dependency: it
only hides the cycle until the function runs). Each module belongs to exactly one layer of
:data:`LAYERS`; an import may point at its own layer or a lower one, never a higher one; no
modules import each other in a circle; and no module loads code by a string
(``importlib.import_module``, ``__import__``) outside :data:`STRING_LOADERS`, each entry of
which says why. ``docs/architecture.md`` draws the same layers: a test holds the page to
:data:`LAYERS`.

The checker is tested on small synthetic trees first, so that a rule that cannot fail shows.
No refdml module is imported here: the walk reads source files.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterable, Mapping

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# The source folders and the package each installs as (pyproject's package-dir).
SOURCES = {"refdml": REPO / "refdml"}

# Bottom to top. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("refdml.exceptions", "refdml._validation", "refdml._numerics", "refdml._backend",
              "refdml._deferred", "refdml._io", "refdml._cli_support")),
    ("operators", ("refdml.normalize", "refdml.distances", "refdml.gsp", "refdml.histogram",
                   "refdml.losses", "refdml.prototypes", "refdml.crossbatch", "refdml.ot",
                   "refdml.kcenter", "refdml.metrics", "refdml.coresets", "refdml._shared")),
    ("fast path", ("refdml.gpu",)),
    ("bridges", ("refdml._interop", "refdml.torch", "refdml.jax")),
    ("harness", ("refdml.gradcheck",)),
    ("training", ("refdml.train",)),
    ("catalogue", ("refdml.catalog",)),
    ("apps", ("refdml.validation", "refdml.reproduce", "refdml.conformance", "refdml.checks",
              "refdml.cli", "refdml.pytest_plugin")),
)

# The package's face: ``refdml/__init__.py`` imports nothing at load time and hands out its
# subpackages on first attribute access, so it stands outside the layers.
FACE = "refdml"

# module -> (why, a phrase its source must use where it says why): the only modules allowed
# to load a module named by a string.
STRING_LOADERS: dict[str, tuple[str, str]] = {
    "refdml": ("lazy access to refdml's own subpackages (`refdml.gsp` without an import), "
               "from a fixed tuple of names; keeps `import refdml` cheap", "lazy"),
    "refdml.conformance._cli": ("`refdml conform PACKAGE.MODULE:CALLABLE` imports the user's "
                                "implementation named on the command line, as pytest and "
                                "uvicorn import theirs", "PACKAGE.MODULE:CALLABLE"),
}


def module_name(path: pathlib.Path, sources: Mapping[str, pathlib.Path]) -> str | None:
    """The dotted name ``path`` installs as, or None when no source folder holds it."""
    for package, folder in sorted(sources.items(), key=lambda item: -len(item[0])):
        try:
            parts = list(path.relative_to(folder).with_suffix("").parts)
        except ValueError:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([package, *parts])
    return None


def source_modules(sources: Mapping[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Every module of the source folders, by the name it installs as."""
    found = {}
    for folder in sources.values():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            name = module_name(path, sources)
            # refdml/ might hold stray copies named like a nested source folder; the
            # longest-prefix match above already gives such a file its installed name.
            found.setdefault(name, path)
    return found


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: Iterable[str]) -> list[str]:
    """The refdml modules an import statement loads (``from a import b``: ``a.b`` when that is
    a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    known = set(modules)
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source
            for a in node.names]


def _is_string_loader(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def scan(sources: Mapping[str, pathlib.Path]):
    """(modules, edges, string loaders): ``edges[m]`` = {(target, line)} of refdml targets."""
    modules = source_modules(sources)
    edges: dict[str, set[tuple[str, int]]] = {}
    loaders: dict[str, list[int]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out = edges.setdefault(name, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path.name == "__init__.py", modules):
                    if target == "refdml" or target.startswith("refdml."):
                        out.add((target, node.lineno))
            elif isinstance(node, ast.Call) and _is_string_loader(node):
                loaders.setdefault(name, []).append(node.lineno)
    return modules, edges, loaders


#: The one module that imports ``numba.cuda`` (refdml.gpu._support.cuda's docstring: a
#: change of CUDA compiler, or a workaround for one, is a change there alone).
CUDA_IMPORT_POINT = "refdml.gpu._support.cuda"


def _numba_cuda_names(node: ast.Import | ast.ImportFrom) -> list[tuple[str, bool]]:
    """``(module, binds_cuda)`` for each ``numba.cuda`` module an import statement loads:
    ``binds_cuda`` where it binds the package itself (``from numba import cuda``,
    ``import numba.cuda``), not where it takes names from it or from a submodule
    (``from numba.cuda.cudadrv import nvvm``)."""
    if isinstance(node, ast.Import):
        return [(a.name, True) for a in node.names if a.name.split(".")[:2] == ["numba", "cuda"]]
    if node.level:
        return []
    module = node.module or ""
    if module == "numba":
        return [("numba.cuda", True) for a in node.names if a.name == "cuda"]
    return [(module, False)] if module.split(".")[:2] == ["numba", "cuda"] else []


def cuda_import_violations(sources: Mapping[str, pathlib.Path],
                           import_point: str = CUDA_IMPORT_POINT) -> list[str]:
    """Imports of ``numba.cuda`` outside the import point: the package bound anywhere else,
    or names taken from it or its submodules (``numba.cuda.dispatcher``) in a module that
    does not also import the import point (whose compatibility step must run first)."""
    found = []
    for name, path in sorted(source_modules(sources).items()):
        if name == import_point:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        uses_point = any(
            (n.module if isinstance(n, ast.ImportFrom) else None) == import_point
            or any(a.name == import_point for a in n.names) for n in nodes)
        for node in nodes:
            for target, binds_cuda in _numba_cuda_names(node):
                if binds_cuda:
                    found.append(f"{name} (line {node.lineno}) imports numba.cuda: take "
                                 f"`cuda` from {import_point}")
                elif not uses_point:
                    found.append(f"{name} (line {node.lineno}) imports from {target} without "
                                 f"importing {import_point}")
    return found


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index into ``layers`` of the longest prefix naming ``module``; None if none does."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def upward_imports(edges, layers=LAYERS, face=FACE) -> list[str]:
    """One line per import from a lower layer to a higher one."""
    found = []
    for importer in sorted(edges):
        low = layer_of(importer, layers)
        for target, line in sorted(edges[importer]):
            high = layer_of(target, layers)
            if importer == face or target == face or low is None or high is None:
                continue
            if high > low:
                found.append(f"{importer} (line {line}, {layers[low][0]}) imports {target} "
                             f"({layers[high][0]})")
    return found


def circles(edges, modules: Iterable[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    known = set(modules)
    graph = {m: sorted({t for t, _ in edges.get(m, ()) if t in known and t != m}) for m in known}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if child < len(graph[node]):
                work.append((node, child + 1))
                nxt = graph[node][child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for succ in graph[node]:
                if succ in on_stack:
                    low[node] = min(low[node], low[succ])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# --------------------------------------------------------------------------- the checker itself


def _tree(tmp_path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"refdml": tmp_path / "refdml", "refdml.gpu": tmp_path / "gpu"}


def test_checker_sees_function_local_upward_imports_through_gpu_folder(tmp_path):
    sources = _tree(tmp_path, {
        "refdml/__init__.py": "",
        "refdml/metrics.py": "def f():\n    from refdml.gpu._nb import g\n    return g\n",
        "gpu/__init__.py": "",
        "gpu/_nb.py": "from refdml import metrics\n",
    })
    modules, edges, _ = scan(sources)
    assert set(modules) == {"refdml", "refdml.metrics", "refdml.gpu", "refdml.gpu._nb"}
    assert upward_imports(edges) == [
        "refdml.metrics (line 2, operators) imports refdml.gpu._nb (fast path)"]
    assert circles(edges, modules) == [["refdml.gpu._nb", "refdml.metrics"]]


def test_checker_resolves_relative_imports_and_string_loaders(tmp_path):
    sources = _tree(tmp_path, {
        "refdml/__init__.py": "",
        "refdml/ot/__init__.py": "from ._a import x\n",
        "refdml/ot/_a.py": "from .. import _backend\nimport importlib\nx = importlib.import_module('m')\n",
        "refdml/_backend.py": "from .ot import _a\n",
    })
    modules, edges, loaders = scan(sources)
    assert ("refdml._backend", 1) in edges["refdml.ot._a"]
    assert ("refdml.ot._a", 1) in edges["refdml.ot"]
    assert upward_imports(edges) == ["refdml._backend (line 1, base) imports refdml.ot._a (operators)"]
    assert loaders == {"refdml.ot._a": [3]}


def test_checker_finds_a_three_module_circle_and_passes_a_chain():
    edges = {"a": {("b", 1)}, "b": {("c", 1)}, "c": {("a", 1)}, "d": {("a", 1)}}
    assert circles(edges, "abcd") == [["a", "b", "c"]]
    edges["c"] = set()
    assert circles(edges, "abcd") == []


def test_checker_keeps_numba_cuda_to_its_import_point(tmp_path):
    sources = _tree(tmp_path, {
        "refdml/__init__.py": "",
        "refdml/gpu/_support/__init__.py": "",
        "refdml/gpu/_support/cuda.py": "from numba import cuda\n",
        "gpu/__init__.py": "def f():\n    import numba.cuda\n",
        "gpu/_nb.py": "from refdml.gpu._support.cuda import cuda\nfrom numba.cuda import dispatcher\n",
        "gpu/_bad.py": "from numba.cuda.cudadrv import nvvm\nfrom numba import cuda, njit\n",
    })
    assert cuda_import_violations(sources) == [
        "refdml.gpu (line 2) imports numba.cuda: take `cuda` from refdml.gpu._support.cuda",
        "refdml.gpu._bad (line 1) imports from numba.cuda.cudadrv without importing "
        "refdml.gpu._support.cuda",
        "refdml.gpu._bad (line 2) imports numba.cuda: take `cuda` from refdml.gpu._support.cuda",
    ]


# --------------------------------------------------------------------------- the seam
#: What the fast path may take from the operators layer besides public names of public
#: modules: the explicit internal API (refdml/_shared/__init__.py).
SHARED_API = "refdml._shared"
FAST_PATH = "refdml.gpu"
#: The one module that chooses among array path, CPU twin and CUDA kernels (its
#: Implementations objects); nowhere else is the kernel mode read.
CHOOSER = "refdml.gpu._support.modes"
CHOICE_CALLS = ("kernel_mode", "select_kernel")


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split(".")[1:])


def private_reference_imports(sources, layers=LAYERS) -> list[str]:
    """Imports of the fast path (:data:`FAST_PATH`) from the operators layer that take a
    private module (``refdml.ot._sinkhorn``) or a private name (``_check_k``), outside
    :data:`SHARED_API`."""
    operators = next(i for i, (name, _) in enumerate(layers) if name == "operators")
    modules = source_modules(sources)
    found = []
    for name, path in sorted(modules.items()):
        if not (name == FAST_PATH or name.startswith(FAST_PATH + ".")):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _targets(ast.ImportFrom(module=node.module, names=[ast.alias(name="*")],
                                               level=node.level), name, is_package, ())[0]
                pairs = [(base, alias.name) for alias in node.names]
            else:
                continue
            for module, imported in pairs:
                if layer_of(module, layers) != operators or module == SHARED_API or \
                        module.startswith(SHARED_API + "."):
                    continue
                submodule = f"{module}.{imported}" if imported else None
                if _is_private(module):
                    found.append(f"{name} (line {node.lineno}) imports from the private "
                                 f"module {module}")
                elif imported and imported.startswith("_") and submodule not in modules:
                    found.append(f"{name} (line {node.lineno}) imports the private name "
                                 f"{module}.{imported}")
                elif submodule in modules and _is_private(submodule):
                    found.append(f"{name} (line {node.lineno}) imports the private module "
                                 f"{submodule}")
    return list(dict.fromkeys(found))       # one line per statement and module


def kernel_choice_calls(sources, chooser=CHOOSER) -> list[str]:
    """Calls of :data:`CHOICE_CALLS` outside the chooser: a choice between kernels made
    in the maths instead of by the family's ``Implementations`` object."""
    found = []
    for name, path in sorted(source_modules(sources).items()):
        if name == chooser:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in CHOICE_CALLS:
                    found.append(f"{name} (line {node.lineno}) calls {called}()")
    return found


def test_seam_checkers_see_private_reference_imports_and_stray_choices(tmp_path):
    sources = _tree(tmp_path, {
        "refdml/__init__.py": "",
        "refdml/ot/__init__.py": "from ._sinkhorn import solve\n",
        "refdml/ot/_sinkhorn.py": "def solve(): pass\ndef _helper(): pass\n",
        "refdml/metrics.py": "def _check_k(): pass\ndef precision(): pass\n",
        "refdml/_shared/__init__.py": "",
        "refdml/_shared/ot.py": "from refdml.ot._sinkhorn import _helper as helper\n",
        "gpu/__init__.py": "",
        "gpu/ok.py": ("from refdml.ot import solve\nfrom refdml._shared.ot import helper\n"
                      "from refdml.metrics import precision\nfrom refdml.gpu._support import modes\n"),
        "gpu/bad.py": ("from refdml.ot._sinkhorn import solve\nfrom refdml.metrics import _check_k\n"
                       "from refdml.ot import _sinkhorn\nimport refdml.ot._sinkhorn\n"
                       "def f(x):\n    return _support.select_kernel(x)\n"),
    })
    assert private_reference_imports(sources) == [
        "refdml.gpu.bad (line 1) imports from the private module refdml.ot._sinkhorn",
        "refdml.gpu.bad (line 2) imports the private name refdml.metrics._check_k",
        "refdml.gpu.bad (line 3) imports the private module refdml.ot._sinkhorn",
        "refdml.gpu.bad (line 4) imports from the private module refdml.ot._sinkhorn",
    ]
    assert kernel_choice_calls(sources) == ["refdml.gpu.bad (line 6) calls select_kernel()"]


def test_fast_path_takes_from_the_reference_public_names_or_the_shared_api():
    found = private_reference_imports(SOURCES)
    assert not found, ("refdml.gpu reaches into the reference's private modules (re-export "
                       "what it needs from refdml/_shared/<family>.py):\n" + "\n".join(found))


def test_only_the_implementations_objects_choose_a_kernel():
    found = kernel_choice_calls(SOURCES)
    assert not found, ("the choice between array path, CPU twin and CUDA kernels is made by "
                       "each family's Implementations object only:\n" + "\n".join(found))


# --------------------------------------------------------------------------- the contract

MODULES, EDGES, LOADERS = scan(SOURCES)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != FACE and layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/architecture.md): {unplaced}"


def test_no_module_imports_a_higher_layer():
    found = upward_imports(EDGES)
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_import_circles():
    found = circles(EDGES, MODULES)
    assert not found, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_numba_cuda_is_imported_at_its_one_import_point():
    found = cuda_import_violations(SOURCES)
    assert not found, "numba.cuda imported past refdml.gpu._support.cuda:\n" + "\n".join(found)
    assert CUDA_IMPORT_POINT in MODULES


def test_no_module_loads_code_by_a_string():
    found = {m: lines for m, lines in LOADERS.items() if m not in STRING_LOADERS}
    assert not found, f"importlib.import_module / __import__ outside STRING_LOADERS: {found}"
    assert set(STRING_LOADERS) <= set(LOADERS), "STRING_LOADERS names a module that loads nothing"


@pytest.mark.parametrize("name, why, phrase",
                         [(name, *entry) for name, entry in sorted(STRING_LOADERS.items())])
def test_string_loaders_say_why_in_their_source(name, why, phrase):
    text = MODULES[name].read_text(encoding="utf-8")
    assert "import_module" in text and phrase.lower() in text.lower(), (
        f"{name} loads by a string; its source should say why ({why})")


def test_architecture_page_draws_these_layers():
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- layers:start -->\n```\n(.*?)```\n<!-- layers:end -->", page, re.S)
    assert block, "docs/architecture.md lacks its layers block"
    drawn = []
    for line in block.group(1).splitlines():
        name, _, rest = line.partition(":")
        if rest.strip():
            drawn.append((name.strip(), tuple(rest.split())))
    top_down = tuple(reversed(LAYERS))
    assert tuple(drawn) == top_down, "docs/architecture.md's layers differ from LAYERS"


# --------------------------------------------------------------------------- the clone's root
def test_fast_path_and_verify_import_from_the_clone_root():
    """``python -c "import refdml.gpu, refdml.train, refdml.validation"`` run in the clone's
    root, where ``python -c`` puts the source folder ``refdml/`` first on ``sys.path``: every
    subpackage must live inside it (issue 35; they used to be top-level folders installed
    under another name, and from the root ``import refdml.gpu`` failed)."""
    import subprocess
    import sys

    code = ("import refdml.gpu, refdml.train, refdml.validation, pathlib; "
            "print(pathlib.Path(refdml.gpu.__file__).resolve())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(REPO / "refdml" / "gpu" / "__init__.py")


def test_every_source_folder_lies_inside_the_package():
    """No Python package at the clone's top level besides ``refdml/`` (``tests/`` and
    ``scripts/`` are not installed): a second one would install under a name it does not
    have in the clone, which is what broke imports from the root."""
    tops = sorted(p.name for p in REPO.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists())
    assert tops == ["refdml"], tops


def test_the_wheel_finds_every_package_of_the_source_tree():
    """pyproject.toml finds refdml's packages (``[tool.setuptools.packages.find]``) instead of
    listing them: a package missing from a list installs editable (the clone is on the path)
    and is absent from the wheel, which broke every non-editable install once (issue 35)."""
    import fnmatch

    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10: the backport refdml itself uses
        import tomli as tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = config["tool"]["setuptools"]
    assert "packages" not in setuptools or isinstance(setuptools["packages"], dict), (
        "an explicit package list: use [tool.setuptools.packages.find]")
    include = setuptools["packages"]["find"]["include"]
    packages = sorted(".".join(p.parent.relative_to(REPO).parts)
                      for p in (REPO / "refdml").rglob("__init__.py")
                      if "__pycache__" not in p.parts)
    missing = [name for name in packages
               if not any(fnmatch.fnmatchcase(name, pattern) for pattern in include)]
    assert packages and not missing, missing
