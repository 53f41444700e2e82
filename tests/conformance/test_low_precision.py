"""Low precision that is really exercised (issue 48): bfloat16 checks that see structural
errors on the seed cases alone, and an output dtype that must be the one asked for.

* Five hand-made wrong implementations (tests/conformance/impls_jax_structural.py), one
  fault each on five operators, fail in bfloat16 on the seeds alone (``reference_cases=
  False``: what ``-k seed`` runs), on every seed, by several times the tolerance; their
  correct twins pass the same cases with errors well inside it.
* An implementation that computes in float32 and returns float32 for a bfloat16 check
  fails with one line, unless ``output_dtype="float32"`` declares it, and then the report
  says so.

The expected error of each defect is derived from the inputs in NumPy, never from the
reference.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import impls_jax as gsp_ot  # noqa: E402  (needs JAX)
import impls_jax_losses as losses  # noqa: E402
import impls_jax_structural as wrong  # noqa: E402

from refdml.catalog import get  # noqa: E402
from refdml.conformance import check_implementation  # noqa: E402
from refdml.conformance._formats import FORMATS  # noqa: E402

SEEDS = 3


def seeds_only(impl, op, dtype="bfloat16", **options):
    """The seed cases alone, as ``pytest -k seed`` runs them through the plugin."""
    options = {"seeds": SEEDS, "search": False, "error_cases": False,
               "reference_cases": False, **options}
    return check_implementation(impl, op, framework="jax", dtype=dtype, **options)


DEFECTS = [
    (wrong.proxy_nca_no_positive_in_denom, losses.proxy_nca, "losses.proxy_nca"),
    (wrong.contrastive_sum_for_mean, losses.contrastive, "losses.contrastive"),
    (wrong.gsp_pool_without_epsilon, gsp_ot.gsp_pool, "gsp.pool"),
    (wrong.proxy_anchor_unnormalised, wrong.proxy_anchor, "losses.proxy_anchor"),
    (wrong.triplet_margin_sign, losses.triplet, "losses.triplet"),
]
IDS = ["missing denominator term", "sum for mean", "missing epsilon",
       "dropped normalisation", "sign error"]


@pytest.mark.parametrize("broken, correct, op", DEFECTS, ids=IDS)
def test_each_structural_defect_fails_in_bfloat16_on_every_seed(broken, correct, op):
    report = seeds_only(broken, op)
    assert not report.passed
    # Every seed fails by value, not only some: the seeds are ordinary inputs.
    assert {f.case for f in report.failures if f.quantity == "output 0"} == {
        f"seed {k}" for k in range(SEEDS)}, report.summary()
    good = seeds_only(correct, op)
    assert good.passed, good.summary()
    # ... and by a margin: on each seed some quantity is off by over twice its tolerance
    # (GSP's pooled output at seed 2 by 1.5 times only; its gradients by 3.5).
    for k in range(SEEDS):
        margin = max(f.error / f.tolerance for f in report.failures
                     if f.case == f"seed {k}" and f.cause in ("value", "gradient"))
        assert margin > 2.0, report.summary()


def _rounded(inputs):
    return {k: FORMATS["bfloat16"].round(v) if isinstance(v, np.ndarray)
            and v.dtype.kind == "f" else v for k, v in inputs.items()}


def _class_probability(inputs):
    """ProxyNCA++'s softmax mass of each embedding's own class (NumPy, at bfloat16's
    values of the inputs)."""
    x, p = inputs["embeddings"], inputs["proxies"]
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    p = p / np.linalg.norm(p, axis=1, keepdims=True)
    logits = -np.sum((x[:, None] - p[None]) ** 2, axis=-1) / inputs["temperature"]
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    same = inputs["labels"][:, None] == inputs["proxy_labels"][None, :]
    return np.sum(weights * same, axis=1) / np.sum(weights, axis=1)


def test_the_proxy_nca_seeds_make_the_missing_term_large():
    """Why the ProxyNCA++ seeds catch it: leaving the own class out of the denominator
    changes each term -log P by -log(1 - P), so the relative error of the mean is
    mean(-log(1 - P)) / mean(-log P): about 0.2 at P ~ 1/4 (random embeddings, within
    bfloat16's 0.125 x kappa on some seeds), above 0.5 once the embeddings sit near their
    proxies, as the catalogue's seeds draw them."""
    report = seeds_only(wrong.proxy_nca_no_positive_in_denom, "losses.proxy_nca")
    errors = {f.case: f.error for f in report.failures if f.quantity == "output 0"}
    for k in range(SEEDS):
        inputs = _rounded(get("losses.proxy_nca").make_inputs(np.random.default_rng(k)))
        probability = _class_probability(inputs)
        assert np.median(probability) > 0.4
        right, wrong_value = -np.log(probability), np.log((1 - probability) / probability)
        predicted = abs(np.mean(wrong_value) - np.mean(right)) / np.mean(right)
        assert predicted > 0.5
        # The implementation rounds in bfloat16: agreement to a few per cent.
        np.testing.assert_allclose(errors[f"seed {k}"], predicted, rtol=0.05)


def test_the_seed_failures_name_the_fault_per_quantity():
    # A sum for a mean multiplies the value by the number of pairs (45 for 10 points).
    report = seeds_only(wrong.contrastive_sum_for_mean, "losses.contrastive")
    n = get("losses.contrastive").make_inputs(np.random.default_rng(0))["labels"].size
    values = [f for f in report.failures if f.quantity == "output 0"]
    for f in values:
        np.testing.assert_allclose(f.impl_value / f.ref_value, n * (n - 1) / 2, rtol=0.05)


# ---------------------------------------------------------------------- output dtype


def contrastive_upcast(embeddings, labels, **options):
    """Computes in float32 whatever it is given, and never casts back."""
    return losses.contrastive(embeddings.astype(jnp.float32), labels, **options)


def test_an_upcast_output_fails_in_bfloat16_with_one_line():
    report = seeds_only(contrastive_upcast, "losses.contrastive", seeds=2)
    assert not report.passed
    dtype = [f for f in report.failures if f.cause == "dtype"]
    assert [(f.case, f.quantity) for f in dtype] == [("seed 0", "output 0"),
                                                     ("seed 1", "output 0")]
    assert dtype[0].message == ('output 0 is float32, asked for bfloat16; compute in '
                                'bfloat16 or declare output_dtype="float32"')
    # The message is one line; the case's reason follows on its own line, as for every cause.
    first, reason = dtype[0].line().splitlines()
    assert first.endswith(dtype[0].message) and reason.strip().startswith("why this case:")
    assert report.verdict().endswith("dtype x2")


def test_a_declared_upcast_passes_and_the_report_says_so():
    report = seeds_only(contrastive_upcast, "losses.contrastive", seeds=2,
                        output_dtype="float32")
    assert report.passed, report.summary()
    note = [n for n in report.notes if "output_dtype" in n]
    assert note and "declared float32" in note[0] and "bfloat16" in note[0]
    assert note[0] in report.summary()
    assert note[0] in report.to_dict()["notes"]
    # A correct bfloat16 implementation with the same declaration is not blamed for it.
    assert seeds_only(losses.contrastive, "losses.contrastive", seeds=1,
                      output_dtype="float32").passed


def test_float16_asked_and_bfloat16_returned_fails():
    def in_bfloat16(embeddings, labels, **options):
        return losses.contrastive(embeddings.astype(jnp.bfloat16), labels, **options)

    report = seeds_only(in_bfloat16, "losses.contrastive", "float16", seeds=1)
    assert [f.message for f in report.failures if f.cause == "dtype"] == [
        "output 0 is bfloat16, asked for float16; return it in float16"]


def test_float32_notes_a_wider_output_and_fails_a_narrower_one():
    """float32 and float64 checks keep today's verdict for a float64 output (a loss
    accumulated in float64 is deliberate; refdml's own float32 losses return one), with
    a note; a float16 output of a float32 check fails."""
    def in_float16(embeddings, labels, **options):
        return losses.contrastive(embeddings.astype(jnp.float16), labels, **options)

    report = seeds_only(in_float16, "losses.contrastive", "float32", seeds=1)
    assert ("output 0", "dtype") in {(f.quantity, f.cause) for f in report.failures}
    spec = get("losses.contrastive")
    wider = check_implementation(spec.forward, "losses.contrastive", framework="numpy",
                                 backward=spec.backward, dtype="float32", seeds=1,
                                 search=False, error_cases=False, reference_cases=False)
    assert wider.passed, wider.summary()


@pytest.mark.parametrize("output_dtype, error, match", [
    ("float8", ValueError, r"output_dtype == 'float8', must be one of"),
    (3, TypeError, r"output_dtype must be one of"),
    ("float16", ValueError, r"output_dtype == 'float16' is less precise than dtype == "
                            r"'float32'"),
])
def test_bad_output_dtype_is_refused_naming_it(output_dtype, error, match):
    with pytest.raises(error, match=match):
        seeds_only(losses.contrastive, "losses.contrastive", "float32",
                   output_dtype=output_dtype)
