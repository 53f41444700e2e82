"""``refdml conform`` as test items in your own pytest suite.

Installing refdml registers this module as a pytest plugin (the ``pytest11`` entry point),
so a test file needs nothing from refdml::

    import pytest
    from mylib.losses import contrastive

    @pytest.mark.refdml_conform("losses.contrastive", framework="jax",
                                dtypes=["float32", "bfloat16"])
    def test_contrastive(refdml_conform):
        refdml_conform(contrastive)

The marker names the catalogue entry, the framework, the dtypes and, optionally, the other
settings of :func:`refdml.conformance.check_implementation` (``seeds``,
``reference_cases``, ``search``, ``max_examples``, ``device``, ``rng``); the
``refdml_conform`` fixture is called with the implementation (and, for a NumPy or CuPy pair,
``backward=``; ``adapter=`` where the signature differs). The test is collected as one item
per dtype and input case, ``test_contrastive[bfloat16-duplicate_points]``, plus one
``...[bfloat16-search]`` for the hypothesis search:

* an item passes when the implementation agrees with the reference on that case, and fails
  with the case's located report lines (quantity, cause, worst element, both values,
  tolerance) otherwise;
* a case the dtype cannot represent, or one the entry states for another range, is a skip
  at collection, with the reason; one the reference refuses is a skip when it runs;
* ``-k bfloat16``, ``-k duplicate_points`` select cases as usual.

Each item runs exactly what ``check_implementation`` runs for that case (the same inputs,
the same cotangents). The error inputs, which a check reports and never fails, are left to
``refdml conform``. The marker's arguments are checked at collection, with the messages of
``check_implementation``.

pytest loads this module in every session where refdml is installed, before the session's
own conftest files. It therefore sits beside refdml's cheap ``__init__`` rather than in
:mod:`refdml.conformance` (whose import loads the catalogue, Numba and the fast path, and
would do so before a conftest could configure them), and imports the rest of refdml only
inside the hooks of a test that uses the marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["MARKER", "CaseCheck", "refdml_conform"]

MARKER = "refdml_conform"

#: The marker's settings and check_implementation's defaults for them (one dtype: float64).
_SETTINGS = {"framework": None, "dtypes": ("float64",), "seeds": 3, "reference_cases": True,
             "search": True, "max_examples": 30, "device": None, "rng": 0}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(op, *, framework, dtypes=('float64',), seeds=3, reference_cases=True, "
        "search=True, max_examples=30, device=None, rng=0): check the implementation passed "
        "to the refdml_conform fixture against refdml's reference, one test item per dtype "
        "and input case (refdml.pytest_plugin)")


@dataclass(frozen=True)
class _Item:
    """What one collected item checks: ``case`` is an index into the planned cases, or
    None for the search."""

    op: str
    dtype: str
    settings: dict[str, Any] = field(hash=False)
    case: int | None
    name: str


def _settings(marker: pytest.Mark) -> tuple[str, dict[str, Any]]:
    """The marker's operator and settings, checked as check_implementation checks them."""
    from refdml._validation import _describe, check_rng
    from refdml.conformance._check import check_settings
    from refdml.conformance._frameworks import FRAMEWORKS

    if len(marker.args) > 1:
        raise TypeError(f"@pytest.mark.{MARKER} takes one positional argument, the "
                        f"operator; got {len(marker.args)}")
    kwargs = dict(marker.kwargs)
    if marker.args:
        if "op" in kwargs:
            raise TypeError(f"@pytest.mark.{MARKER}: op given twice")
        kwargs["op"] = marker.args[0]
    if "op" not in kwargs:
        raise TypeError(f"@pytest.mark.{MARKER} needs the operator, e.g. "
                        f"@pytest.mark.{MARKER}('losses.contrastive', framework='jax')")
    op = kwargs.pop("op")
    unknown = sorted(set(kwargs) - set(_SETTINGS))
    if unknown:
        raise TypeError(f"@pytest.mark.{MARKER}: unknown argument(s) {unknown}; it takes op "
                        f"and {sorted(_SETTINGS)}")
    settings = dict(_SETTINGS, **kwargs)
    if settings["framework"] is None:
        raise TypeError(f"@pytest.mark.{MARKER} needs framework=, one of {FRAMEWORKS}")
    dtypes = settings["dtypes"]
    if isinstance(dtypes, str) or not isinstance(dtypes, (list, tuple)) or not dtypes:
        raise TypeError(f"dtypes must be a non-empty list of dtype names, got "
                        f"{_describe(dtypes)}")
    checked = [check_settings(op, framework=settings["framework"], dtype=dtype,
                              seeds=settings["seeds"],
                              reference_cases=settings["reference_cases"], error_cases=True,
                              search=settings["search"],
                              max_examples=settings["max_examples"]) for dtype in dtypes]
    settings["dtypes"] = tuple(dict.fromkeys(c.dtype for c in checked))
    check_rng(settings["rng"])
    if not isinstance(settings["rng"], (int, type(None))):
        raise TypeError("rng must be None or an int seed here (each item draws the same "
                        f"seeds from it), got {_describe(settings['rng'])}")
    if settings["device"] is not None and not isinstance(settings["device"], str):
        raise TypeError(f"device must be None or a string such as 'cpu' or 'cuda', got "
                        f"{_describe(settings['device'])}")
    return op, settings


def _slug(text: str) -> str:
    """A case's name as a test id: whitespace to ``_``, so that ``-k`` can name it."""
    return re.sub(r"\s+", "_", text.strip())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "refdml_conform" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid} uses the refdml_conform fixture without "
            f"@pytest.mark.{MARKER}(op, framework=..., dtypes=[...])")
    from refdml._validation import check_rng
    from refdml.conformance._check import get_spec, plan_cases

    op, settings = _settings(marker)
    spec = get_spec(op)
    params = []
    for dtype in settings["dtypes"]:
        planned = plan_cases(spec, dtype, settings["seeds"], settings["reference_cases"],
                             check_rng(settings["rng"]))
        for index, case in enumerate(planned):
            marks = () if case.skip is None else (pytest.mark.skip(reason=case.skip),)
            params.append(pytest.param(_Item(op, dtype, settings, index, case.name),
                                       id=f"{dtype}-{_slug(case.name)}", marks=marks))
        if settings["search"]:
            params.append(pytest.param(_Item(op, dtype, settings, None, "search"),
                                       id=f"{dtype}-search"))
    metafunc.parametrize("refdml_conform", params, indirect=True)


class CaseCheck:
    """The ``refdml_conform`` fixture's value: call it with the implementation to check
    this item's case; it returns the case's result, or fails or skips the test."""

    def __init__(self, item: _Item) -> None:
        self.item = item

    def __repr__(self) -> str:
        return f"<refdml_conform {self.item.op} {self.item.dtype} {self.item.name!r}>"

    def __call__(self, impl: Any, *, backward: Any = None, adapter: Any = None):
        from refdml.conformance._check import Conformance

        item, settings = self.item, self.item.settings
        conformance = Conformance(
            impl, item.op, framework=settings["framework"], dtype=item.dtype,
            adapter=adapter, backward=backward, device=settings["device"],
            seeds=settings["seeds"], reference_cases=settings["reference_cases"],
            error_cases=False, search=settings["search"],
            max_examples=settings["max_examples"], rng=settings["rng"])
        head = f"{item.op} ({settings['framework']}, {item.dtype})"
        if item.case is None:
            outcome, found = conformance.run_search()
            if found is not None:
                pytest.fail(f"{head}: the search found a disagreement, shrunk to seed="
                            f"{outcome.seed}, digits={outcome.digits}:\n"
                            + "\n".join(f.line() for f in found.failures), pytrace=False)
            if not outcome.examples:
                pytest.skip(f"{head}: the search compared no draw ({outcome.note})")
            return outcome
        case = conformance.cases()[item.case]
        result = conformance.check_case(case)
        if result.skipped is not None:
            pytest.skip(f"{head}, {case.name}: {result.skipped}")
        if result.failures:
            pytest.fail(f"{head}: {len(result.failures)} failure"
                        f"{'s' if len(result.failures) != 1 else ''} in {case.name!r}:\n"
                        + "\n".join(f.line() for f in result.failures), pytrace=False)
        return result


@pytest.fixture
def refdml_conform(request: pytest.FixtureRequest) -> CaseCheck:
    """Check an implementation on this item's case: ``refdml_conform(impl, backward=None,
    adapter=None)``; the test needs ``@pytest.mark.refdml_conform(op, framework=...,
    dtypes=[...])`` (see :mod:`refdml.pytest_plugin`)."""
    return CaseCheck(request.param)
