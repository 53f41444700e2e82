"""Branches on the array library outside the backend object: there are none.

Everything that differs between NumPy and CuPy is a method of :class:`refdml._backend.Backend`
(issue 45, item 3); the maths calls it and never asks which library it runs on. An AST walk
over every module of ``refdml/`` except ``refdml/_backend.py`` lists each place that asks:

* ``X is np`` / ``X is not np`` (also ``numpy`` and ``cupy`` as the compared name);
* the attribute ``.on_gpu``;
* a call of ``is_device_array`` or ``is_cupy_array``;
* ``sys.modules.get("cupy")``, ``sys.modules["cupy"]`` and ``"cupy" in sys.modules`` (also
  ``cupyx``);
* a ``.name`` (or ``.__name__``) attribute compared with ``"cupy"`` or ``"numpy"`` (``==``,
  ``!=``, ``in``, ``not in`` a tuple, list or set of strings).

What a user chose (``device == "cuda"``, ``backend == "numpy"`` of a command line) is not a
branch on an array's library and is not counted. The counter is tested on small synthetic
sources first, so that a pattern it cannot find shows. No refdml module is imported here:
the walk reads source files.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "refdml"
#: The one module allowed to ask which library an array belongs to.
BACKEND_MODULE = PACKAGE / "_backend.py"

_LIBRARY_NAMES = {"np", "numpy", "cupy"}
_LIBRARY_STRINGS = {"numpy", "cupy"}
_PREDICATES = {"is_device_array", "is_cupy_array"}


def _is_cupy_string(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.split(".")[0] in ("cupy", "cupyx"))


def _is_sys_modules(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _library_strings(node: ast.AST) -> bool:
    """A string constant "numpy"/"cupy", or a tuple/list/set literal holding one."""
    if isinstance(node, ast.Constant):
        return node.value in _LIBRARY_STRINGS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in _LIBRARY_STRINGS for e in node.elts)
    return False


def _branches_in_compare(node: ast.Compare) -> list[str]:
    found = []
    left = node.left
    for op, right in zip(node.ops, node.comparators):
        pair = (left, right)
        if isinstance(op, (ast.Is, ast.IsNot)) and any(
                isinstance(side, ast.Name) and side.id in _LIBRARY_NAMES for side in pair):
            name = next(s.id for s in pair if isinstance(s, ast.Name) and s.id in _LIBRARY_NAMES)
            found.append(f"`{'is not' if isinstance(op, ast.IsNot) else 'is'} {name}`")
        elif isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            for attribute, other in (pair, pair[::-1]):
                if (isinstance(attribute, ast.Attribute) and attribute.attr in ("name", "__name__")
                        and _library_strings(other)):
                    found.append(f"`.{attribute.attr}` compared with a library's name")
                    break
            if isinstance(op, (ast.In, ast.NotIn)) and _is_cupy_string(left) \
                    and _is_sys_modules(right):
                found.append("`in sys.modules` of cupy")
        left = right
    return found


def backend_branches(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, what)`` for each branch on the array library in ``source`` (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, what) for what in _branches_in_compare(node)]
        elif isinstance(node, ast.Attribute) and node.attr == "on_gpu":
            found.append((node.lineno, "`.on_gpu`"))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in _PREDICATES:
                found.append((node.lineno, f"`{called}()`"))
            elif (called == "get" and isinstance(func, ast.Attribute) and _is_sys_modules(func.value)
                  and node.args and _is_cupy_string(node.args[0])):
                found.append((node.lineno, "`sys.modules.get()` of cupy"))
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) \
                and _is_cupy_string(node.slice):
            found.append((node.lineno, "`sys.modules[]` of cupy"))
    return sorted(found)


def branches_in_tree(root: pathlib.Path, *, skip: pathlib.Path) -> list[str]:
    """``path:line: what`` for every branch in the modules under ``root`` but ``skip``."""
    lines = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or path == skip:
            continue
        relative = path.relative_to(root.parent).as_posix()
        for line, what in backend_branches(path.read_text(encoding="utf-8"), str(path)):
            lines.append(f"{relative}:{line}: {what}")
    return lines


# --------------------------------------------------------------------------- the counter itself
@pytest.mark.parametrize("source, what", [
    ("if xp is np:\n    pass\n", "`is np`"),
    ("flag = xp is not np\n", "`is not np`"),
    ("flag = np is xp\n", "`is np`"),
    ("flag = module is cupy\n", "`is cupy`"),
    ("flag = ns.on_gpu\n", "`.on_gpu`"),
    ("flag = is_device_array(x)\n", "`is_device_array()`"),
    ("flag = _backend.is_device_array(x)\n", "`is_device_array()`"),
    ("flag = is_cupy_array(x)\n", "`is_cupy_array()`"),
    ("cupy = sys.modules.get('cupy')\n", "`sys.modules.get()` of cupy"),
    ("cupyx = sys.modules.get('cupyx')\n", "`sys.modules.get()` of cupy"),
    ("cupy = sys.modules['cupy']\n", "`sys.modules[]` of cupy"),
    ("flag = 'cupy' in sys.modules\n", "`in sys.modules` of cupy"),
    ("flag = backend.name == 'cupy'\n", "`.name` compared with a library's name"),
    ("flag = 'numpy' != ns.name\n", "`.name` compared with a library's name"),
    ("flag = ns.name in ('cupy', 'other')\n", "`.name` compared with a library's name"),
    ("flag = xp.__name__ == 'numpy'\n", "`.__name__` compared with a library's name"),
])
def test_counter_finds_each_pattern(source, what):
    assert backend_branches("import sys\n\n\ndef f(x, xp, ns):\n" + "".join(
        "    " + line + "\n" for line in source.splitlines())) == [(5, what)]


def test_counter_passes_what_is_no_branch_on_the_library():
    source = (
        "import os, sys\n"
        "import numpy as np\n"
        "def f(x, ns, spec, name, backend, device):\n"
        "    y = ns.xp.asarray(x) if x is not None else np.zeros(3)\n"
        "    ns.synchronize()\n"
        "    numba = sys.modules.get('numba')\n"
        "    other = sys.modules['numpy']\n"
        "    if spec.name == name or os.name != 'posix' or spec.name == 'gsp.pool':\n"
        "        pass\n"
        "    if backend == 'numpy' or device == 'cuda':\n"
        "        pass\n"
        "    label = f'{ns.name} arrays'\n"
        "    return is_array(x), to_numpy(y), np.isnan(y)\n"
        "def on_gpu():\n"
        "    return 'cupy'\n"
    )
    assert backend_branches(source) == []


def test_counter_reports_every_branch_of_a_line_and_walks_a_tree(tmp_path):
    package = tmp_path / "refdml"
    (package / "gpu").mkdir(parents=True)
    (package / "_backend.py").write_text("flag = xp is np\n")
    (package / "gpu" / "ops.py").write_text("\nflag = xp is np and ns.on_gpu\n")
    (package / "metrics.py").write_text("x = 1\n")
    assert branches_in_tree(package, skip=package / "_backend.py") == [
        "refdml/gpu/ops.py:2: `.on_gpu`", "refdml/gpu/ops.py:2: `is np`"]


# --------------------------------------------------------------------------- refdml
BRANCHES = branches_in_tree(PACKAGE, skip=BACKEND_MODULE)


def test_no_backend_branches_outside_the_backend_module():
    assert not BRANCHES, ("branches on the array library outside refdml/_backend.py (use a "
                          "method of the Backend, or add one):\n" + "\n".join(BRANCHES))
