"""Failures that explain themselves, and ``describe`` / ``refdml conform --describe``.

A failure names why its case exists (the catalogue's ``Case.why``) under its line, in the
report's summary and, whole, in its JSON; ``describe(op)`` lists what a check passes,
compares and allows, all read from the catalogue; conform's bad choices are one line.
The wrong implementations are NumPy pairs, so that these tests run in the lean install.
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import numpy as np
import pytest

from refdml import catalog
from refdml.cli import main
from refdml.conformance import OperatorDescription, check_implementation, describe
from refdml.conformance._formats import DTYPES
from refdml.conformance._report import REASON_WIDTH, short_reason
from refdml.conformance._tolerance import base_tolerance


def naive_forward(x):
    # The planted defect: the norm squares first, so 1e30 overflows float32.
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    y = x / norm
    return y, (y, norm)


def naive_backward(ctx, d_y):
    y, norm = ctx
    return {"x": (d_y - y * np.sum(y * d_y, axis=-1, keepdims=True)) / norm}


def flipped_forward(x):
    # A sign error: wrong on every input.
    y, ctx = naive_forward(x)
    return -y, ctx


def _why(op: str, case: str) -> str:
    spec = catalog.get(op)
    return {c.name: c.why for c in spec.reference_inputs(np.random.default_rng(0))}[case]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def naive_float32():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_implementation(naive_forward, "normalize.l2_normalize", framework="numpy",
                                    backward=naive_backward, dtype="float32", seeds=1,
                                    search=False, error_cases=False)


def test_a_failure_line_carries_its_cases_reason(naive_float32):
    why = _why("normalize.l2_normalize", "float32 edge")
    failing = [f for f in naive_float32.failures if f.case == "float32 edge"]
    assert failing, naive_float32.summary()
    for failure in failing:
        first, second = failure.line().split("\n")
        assert first.startswith("float32 edge: ")
        assert second == f"    why this case: {short_reason(why)}"
        assert failure.reason == why


def test_a_long_reason_is_cut_after_a_clause():
    why = _why("normalize.l2_normalize", "float32 edge")
    assert len(why) > REASON_WIDTH          # else the cut is not exercised
    short = short_reason(why)
    assert len(short) <= REASON_WIDTH and short.endswith(" ...")
    assert why.startswith(short[: -len(" ...")])


def test_the_summary_and_the_json_carry_the_reason(naive_float32):
    why = _why("normalize.l2_normalize", "float32 edge")
    summary = naive_float32.summary()
    assert f"why this case: {short_reason(why)}" in summary
    data = json.loads(json.dumps(naive_float32.to_dict()))
    reasons = {f["reason"] for f in data["failures"] if f["case"] == "float32 edge"}
    assert reasons == {why}                  # whole, not cut


def test_seed_and_search_cases_say_what_they_are():
    report = check_implementation(flipped_forward, "normalize.l2_normalize",
                                  framework="numpy", backward=naive_backward, seeds=2,
                                  reference_cases=False, error_cases=False, max_examples=5)
    by_case = {f.case: f.reason for f in report.failures}
    assert "make_inputs(default_rng(1))" in by_case["seed 1"]
    searched = [case for case in by_case if case.startswith("search")]
    assert searched and "hypothesis search" in by_case[searched[0]]
    assert report.search.failures and all(f.reason for f in report.search.failures)


def test_the_cli_prints_the_reason_under_each_failure(tmp_path, monkeypatch, capsys):
    (tmp_path / "naive_l2_describe.py").write_text(
        "import numpy as np\n\n"
        "def forward(x):\n"
        "    n = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))\n"
        "    return x / n, (x / n, n)\n\n"
        "def backward(ctx, d_y):\n"
        "    y, n = ctx\n"
        "    return {'x': (d_y - y * np.sum(y * d_y, axis=-1, keepdims=True)) / n}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["conform", "naive_l2_describe:forward", "--backward",
                     "naive_l2_describe:backward", "--op", "normalize.l2_normalize",
                     "--framework", "numpy", "--dtype", "float32", "--seeds", "1",
                     "--no-search", "--json", str(out)])
    printed = capsys.readouterr().out
    why = _why("normalize.l2_normalize", "float32 edge")
    assert code == 1
    assert f"why this case: {short_reason(why)}" in printed
    assert why in {f["reason"] for f in json.loads(out.read_text())["failures"]}


# -- describe ---------------------------------------------------------------------------

OPS = ["normalize.l2_normalize", "gsp.pool", "ot.sinkhorn_divergence", "losses.proxy_nca",
       "train.conv2d"]


def _keywords(spec) -> list[str]:
    names = list(spec.make_inputs(np.random.default_rng(0)))
    if spec.reference_inputs is not None:
        for case in spec.reference_inputs(np.random.default_rng(0)):
            names += [n for n in case.inputs if n not in names]
    return names


@pytest.mark.parametrize("op", OPS)
def test_describe_lists_keywords_cases_and_tolerances(op):
    spec = catalog.get(op)
    description = describe(op)
    assert isinstance(description, OperatorDescription)
    text = str(description)
    flat = _flat(text)
    meanings = spec.parameter_docs()
    for name in _keywords(spec):
        assert f"\n  {name}: " in text, name
        assert meanings.get(name), f"{op}: no meaning for {name!r}"
        assert _flat(meanings[name])[:40] in flat, name
    for case in spec.reference_inputs(np.random.default_rng(0)):
        assert f"\n  {case.name}" in text and _flat(case.why) in flat, case.name
    assert "make_inputs(default_rng(k))" in flat          # the seed cases
    table = text[text.index("\ntolerances: "):]
    for dtype in DTYPES:
        row = next(line for line in table.splitlines() if line.startswith(f"  {dtype} "))
        assert f"{base_tolerance(spec, dtype):.3g}" in row.split()
    data = description.to_dict()
    assert [p["name"] for p in data["parameters"]] == _keywords(spec)
    assert {t["dtype"] for t in data["tolerances"]} == set(DTYPES)


def test_describe_says_where_a_case_does_not_run():
    text = str(describe("gsp.pool"))
    # Stated for float32's range: runs in float32 and bfloat16 (the same range) only.
    assert "\n  float32 edge  [in float32, bfloat16]\n" in text
    # Admitted in float16 but beyond its range: said why.
    assert "not in float16: inverse_temperature == 1000000.0 beyond float16's range" in text


def test_describe_of_an_unknown_operator_names_the_catalogue():
    with pytest.raises(ValueError, match=r"op == 'gsp.pol' is not in the catalogue"):
        describe("gsp.pol")


def test_every_catalogued_keyword_has_a_meaning():
    missing = {spec.name: [n for n in _keywords(spec) if not spec.parameter_docs().get(n)]
               for spec in catalog.all_operators()}
    assert not {op: names for op, names in missing.items() if names}


def test_an_operator_spec_prints_readably():
    spec = catalog.get("gsp.pool")
    shown = repr(spec)
    assert shown.startswith("OperatorSpec('gsp.pool', forward=refdml.gsp.")
    assert "make_inputs=" not in shown and "<function" not in shown
    text = str(spec)
    assert text.splitlines()[0] == f"gsp.pool: {spec.paper}"
    assert "refdml conform --describe gsp.pool" in text
    for name in spec.make_inputs(np.random.default_rng(0)):
        assert f"\n    {name}: " in text


# -- the CLI ----------------------------------------------------------------------------

def test_conform_describe_prints_the_description(capsys):
    assert main(["conform", "--describe", "gsp.pool"]) == 0
    assert capsys.readouterr().out == str(describe("gsp.pool")) + "\n"


@pytest.mark.parametrize("argv, fragment", [
    (["--describe", "gsp.pol"], "--describe 'gsp.pol' is not a catalogued operator (did you "
                                "mean gsp.pool"),
    (["--describe", "gsp.pool", "--framework", "torch"], "--describe gsp.pool takes no other "
                                                         "argument; drop --framework"),
    (["--dtype", "float8"], "--dtype 'float8' is not one of float64, float32, float16, "
                            "bfloat16"),
    (["m:f", "--op", "gsp.pool", "--framework", "numpy", "--dtype", "float8"],
     "--dtype 'float8' is not one of"),
    (["m:f", "--op", "gsp.pool", "--framework", "tensorflow"],
     "--framework 'tensorflow' is not one of torch, jax, numpy, cupy"),
    (["m:f", "--op", "gsp.pool", "--framework", "jaxx"], "(did you mean jax?)"),
    (["--op", "gsp.pool", "--framework", "numpy"], "IMPLEMENTATION is missing"),
    (["m:f", "--framework", "numpy"], "--op is missing"),
    (["m:f", "--op", "gsp.pool"], "--framework is missing"),
], ids=["unknown-op", "describe-with-check-flag", "float8", "float8-full", "tensorflow",
        "jaxx", "no-implementation", "no-op", "no-framework"])
def test_bad_conform_arguments_are_one_line_and_exit_2(capsys, argv, fragment):
    code = main(["conform", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("refdml conform: error: ") and fragment in captured.err


def test_conform_help_points_to_describe(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["conform", "--help"])
    assert exited.value.code == 0
    shown = _flat(capsys.readouterr().out)
    assert "--describe OP" in shown and "refdml conform --describe gsp.pool" in shown
    assert "refdml gradcheck" not in shown


def test_the_docs_show_the_real_describe_output():
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "conformance.md").read_text(
        encoding="utf-8")
    shown = re.search(r"```text\n(normalize\.l2_normalize: .*?)```", page, re.S)
    assert shown, "docs/conformance.md lost its --describe example"
    # Regenerate with: refdml conform --describe normalize.l2_normalize
    assert shown.group(1) == str(describe("normalize.l2_normalize")) + "\n"
