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
``reference_cases``, ``search``, ``max_examples``, ``device``, ``rng``, ``output_dtype``); the
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
``refdml conform``.

The plugin fails closed: a marked test passes only when its check ran and passed.

* A marked test whose body returns without calling the fixture (forgotten, or called in a
  branch not taken) fails: "the marker's check never ran". One that catches the check's
  failure or skip gets that failure or skip back. A skip or xfail raised by the test's body
  stays what it is.
* A wrong marker (an operator that is not catalogued, with "did you mean"; an unknown
  argument, framework or dtype; a bad setting, with the message ``check_implementation``
  gives), a marker on a test that does not take the fixture, and the fixture without the
  marker are each one error, a single line, for that test alone, when it runs; the rest of
  the suite runs.
* A framework that cannot be imported (``framework="jax"`` without JAX) skips its items
  with the reason ``refdml conform`` gives. With the ini option
  ``refdml_conform_strict = true`` (or ``-o refdml_conform_strict=true``) it is an error
  instead, for a CI that must run every check.

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
             "search": True, "max_examples": 30, "device": None, "rng": 0,
             "output_dtype": None}


#: The ini option that turns a framework that cannot be imported from a skip into an error.
STRICT = "refdml_conform_strict"

#: The one fixture, the test argument that runs the marker's check.
FIXTURE = "refdml_conform"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(STRICT, type="bool", default=False,
                  help=f"@pytest.mark.{MARKER}: a framework that cannot be imported is an "
                       "error, not a skip (refdml.pytest_plugin)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(op, *, framework, dtypes=('float64',), seeds=3, reference_cases=True, "
        "search=True, max_examples=30, device=None, rng=0, output_dtype=None): check the "
        "implementation passed to the refdml_conform fixture against refdml's reference, "
        "one test item per dtype and input case; the test must call the fixture (refdml.pytest_plugin)")


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
    """The marker's operator and settings, checked as check_implementation checks them
    (``TypeError``/``ValueError`` naming the argument and the value)."""
    from refdml._validation import _describe, check_rng
    from refdml.conformance._check import check_settings
    from refdml.conformance._frameworks import FRAMEWORKS
    from refdml.conformance._usage import did_you_mean, unknown_operator

    if len(marker.args) > 1:
        raise TypeError(f"takes one positional argument, the operator; got "
                        f"{len(marker.args)}")
    kwargs = dict(marker.kwargs)
    if marker.args:
        if "op" in kwargs:
            raise TypeError("op given twice")
        kwargs["op"] = marker.args[0]
    if "op" not in kwargs:
        raise TypeError(f"needs the operator, e.g. @pytest.mark.{MARKER}("
                        "'losses.contrastive', framework='jax')")
    op = kwargs.pop("op")
    unknown = sorted(set(kwargs) - set(_SETTINGS))
    if unknown:
        hint = did_you_mean(unknown[0], _SETTINGS) if len(unknown) == 1 else ""
        raise TypeError(f"unknown argument(s) {unknown}{hint}; it takes op and "
                        f"{sorted(_SETTINGS)}")
    if not isinstance(op, str):
        raise TypeError(f"op must be the name of a catalogue entry (a string), got "
                        f"{_describe(op)}")
    problem = unknown_operator(op, list_if_none_close=True)
    if problem is not None:
        raise ValueError(f"op {problem}")
    settings = dict(_SETTINGS, **kwargs)
    if settings["framework"] is None:
        raise TypeError(f"needs framework=, one of {FRAMEWORKS}")
    dtypes = settings["dtypes"]
    if isinstance(dtypes, str) or not isinstance(dtypes, (list, tuple)) or not dtypes:
        raise TypeError(f"dtypes must be a non-empty list of dtype names, got "
                        f"{_describe(dtypes)}")
    checked = [check_settings(op, framework=settings["framework"], dtype=dtype,
                              seeds=settings["seeds"],
                              reference_cases=settings["reference_cases"], error_cases=True,
                              search=settings["search"],
                              max_examples=settings["max_examples"],
                              output_dtype=settings["output_dtype"]) for dtype in dtypes]
    settings["dtypes"] = tuple(dict.fromkeys(c.dtype for c in checked))
    check_rng(settings["rng"])
    if not isinstance(settings["rng"], (int, type(None))):
        raise TypeError("rng must be None or an int seed here (each item draws the same "
                        f"seeds from it), got {_describe(settings['rng'])}")
    if settings["device"] is not None and not isinstance(settings["device"], str):
        raise TypeError(f"device must be None or a string such as 'cpu' or 'cuda', got "
                        f"{_describe(settings['device'])}")
    return op, settings


def _marker_problem(marker: pytest.Mark) -> str | None:
    """What is wrong with the marker, in one line; None when nothing is."""
    try:
        _settings(marker)
    except (TypeError, ValueError) as error:
        return f"@pytest.mark.{MARKER}: {error}"
    return None


def _slug(text: str) -> str:
    """A case's name as a test id: whitespace to ``_``, so that ``-k`` can name it."""
    return re.sub(r"\s+", "_", text.strip())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A wrong marker, or the fixture without one, leaves the test unparametrized here:
    # raising would stop the whole session at collection. pytest_runtest_setup makes it
    # one error of that test instead.
    if FIXTURE not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    try:
        op, settings = _settings(marker)
    except (TypeError, ValueError):
        return
    from refdml._validation import check_rng
    from refdml.conformance._check import get_spec, plan_cases

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
    metafunc.parametrize(FIXTURE, params, indirect=True)


def _setup_problem(item: pytest.Item) -> str | None:
    """Why a test that has the marker or the fixture cannot run its check, in one line;
    None when it can (or it has neither)."""
    marker = item.get_closest_marker(MARKER)
    uses = FIXTURE in getattr(item, "fixturenames", ())
    if marker is None:
        if not uses:
            return None
        return (f"{item.name} uses the {FIXTURE} fixture without @pytest.mark.{MARKER}(op, "
                "framework=..., dtypes=[...]), which says what to check")
    callspec = getattr(item, "callspec", None)
    if callspec is not None and isinstance(callspec.params.get(FIXTURE), _Item):
        return None     # a valid marker: pytest_generate_tests made this item from it
    problem = _marker_problem(marker)
    if problem is not None:
        return problem
    return (f"@pytest.mark.{MARKER} on a test that does not take the {FIXTURE} fixture: "
            f"its check never runs; add {FIXTURE} to the test's arguments and call "
            f"{FIXTURE}(your_implementation) in its body")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Not tryfirst: a skip or skipif mark on the test (evaluated by pytest's own tryfirst
    # hook) still skips a test whose marker is wrong.
    problem = _setup_problem(item)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    # trylast: after pytest's own hook has run the test's body, and only if the body
    # returned (a failure, skip or xfail it raised propagates before this runs).
    check = getattr(item, "funcargs", {}).get(FIXTURE)
    if isinstance(check, CaseCheck):
        check.settle()


def _stand_in_backward(ctx: Any, *cotangents: Any) -> Any:
    """Never called: the pair's backward comes with the fixture's call, and this stands in
    for it while the framework is imported and its device checked, before the test runs."""
    raise AssertionError("the stand-in backward is never called")


def _require_framework(settings: dict[str, Any], config: pytest.Config) -> None:
    """Import the marker's framework and check its device before the test's body runs: a
    framework that cannot be imported skips the item with ``refdml conform``'s reason (an
    error with the ini option ``refdml_conform_strict``); a device it refuses is an error."""
    from refdml.conformance._frameworks import get_framework
    from refdml.conformance._usage import framework_unavailable

    name = settings["framework"]
    # The outcome is raised after the except clause, so that it is not reported as raised
    # "during handling of" the framework's error.
    unavailable = refused = None
    try:
        get_framework(name, device=settings["device"],
                      backward=None if name in ("torch", "jax") else _stand_in_backward)
    except ImportError as error:
        unavailable = f"framework {name}: {framework_unavailable(name, error)}"
    except (TypeError, ValueError) as error:
        refused = f"@pytest.mark.{MARKER}: {error}"
    if refused is not None:
        pytest.fail(refused, pytrace=False)
    if unavailable is not None:
        if config.getini(STRICT):
            pytest.fail(f"{unavailable} ({STRICT} is set)", pytrace=False)
        pytest.skip(unavailable)


class CaseCheck:
    """The ``refdml_conform`` fixture's value: call it with the implementation to check
    this item's case; it returns the case's result, or fails or skips the test.

    It remembers whether it ran: a test whose body returns without a completed call, or
    after catching the call's failure or skip, does not pass (:meth:`settle`)."""

    def __init__(self, item: _Item) -> None:
        self.item = item
        self.completed = 0
        self.caught: BaseException | None = None

    def __repr__(self) -> str:
        return f"<refdml_conform {self.item.op} {self.item.dtype} {self.item.name!r}>"

    def __call__(self, impl: Any, *, backward: Any = None, adapter: Any = None):
        try:
            result = self._check(impl, backward=backward, adapter=adapter)
        except BaseException as error:
            # Kept until the body returns: re-raised there if the body swallowed it.
            if self.caught is None:
                self.caught = error
            raise
        self.completed += 1
        return result

    def settle(self) -> None:
        """Called once the test's body has returned: re-raise a failure or skip of the
        check that the body caught, and fail if the check never ran."""
        if self.caught is not None:
            raise self.caught
        if not self.completed:
            pytest.fail(f"@pytest.mark.{MARKER}'s check never ran: the test returned without "
                        f"calling the {FIXTURE} fixture; call {FIXTURE}(your_implementation) "
                        "on every path of its body", pytrace=False)

    def _check(self, impl: Any, *, backward: Any, adapter: Any):
        from refdml.conformance._check import Conformance

        item, settings = self.item, self.item.settings
        conformance = Conformance(
            impl, item.op, framework=settings["framework"], dtype=item.dtype,
            adapter=adapter, backward=backward, device=settings["device"],
            seeds=settings["seeds"], reference_cases=settings["reference_cases"],
            error_cases=False, search=settings["search"],
            max_examples=settings["max_examples"], rng=settings["rng"],
            output_dtype=settings["output_dtype"])
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
    dtypes=[...])`` and must call it (see :mod:`refdml.pytest_plugin`)."""
    item = getattr(request, "param", None)
    if not isinstance(item, _Item):
        # Only through request.getfixturevalue: a test argument is parametrized at
        # collection, or failed by pytest_runtest_setup.
        pytest.fail(f"the {FIXTURE} fixture is made for each case at collection: take it as "
                    f"an argument of a test marked @pytest.mark.{MARKER}(...)", pytrace=False)
    _require_framework(item.settings, request.config)
    return CaseCheck(item)
