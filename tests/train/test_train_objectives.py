"""refdml.train.objectives: finite differences of every objective (outputs and its own
parameters, through a small adapter, random upstream), fast path vs reference in float64,
named errors, ASAP's re-initialisation vs select_proxies."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.crossbatch import zero_shot_loss
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.kcenter import select_proxies
from refdml import losses
from refdml.losses import proxy_nca
from refdml.train import Parameter
from refdml.train.objectives import (
    ASAPObjective,
    GSPObjective,
    LossObjective,
    ObjectiveContext,
    WassersteinObjective,
    XMLObjective,
)

LABELS = np.array([0, 0, 1, 1, 2, 2, 3, 3])
SPLIT = np.isin(LABELS, [0, 2])            # class-disjoint halves {0, 2} | {1, 3}
TIGHT = dict(tol=1e-12, max_iter=5000)
# Smooth settings (every hinge active, away from its kink, whatever the draw).
SMOOTH = {
    "contrastive": dict(pos_margin=0.0, neg_margin=100.0),
    "triplet": dict(margin=50.0),
    "proxy_nca": dict(n_classes=4, dim=5),
    "proxy_anchor": dict(n_classes=4, dim=5, alpha=4.0),
    "soft_triple": dict(n_classes=4, dim=5, proxies_per_class=2),
    # Unit-row distances are at most 2: every negative hinge active; MS mines every pair.
    "proxy_contrastive": dict(n_classes=4, dim=5, proxies_per_class=2, pos_margin=0.0,
                              neg_margin=2.5),
    "proxy_multi_similarity": dict(n_classes=4, dim=5, proxies_per_class=2, mining_margin=4.0),
}
# ASAP's bases with the smooth settings of their loss (the objective supplies n_classes, dim).
ASAP_SMOOTH = {
    "proxy_nca": {}, "proxy_anchor": dict(alpha=4.0),
    "contrastive": dict(pos_margin=0.0, neg_margin=2.5),
    "multi_similarity": dict(mining_margin=4.0),
}


def _key(parameter: Parameter) -> str:
    return "param_" + parameter.name.replace(".", "_")


def _gradcheck(objective, outputs: dict, *, labels=LABELS, extra=(), seed=0, **forward_kwargs):
    """FD check of ``objective`` w.r.t. its outputs, its parameters and ``extra`` ones.

    The adapter sets each parameter's value from the check's input, runs the objective's
    forward, and returns the d_outputs and the ``.grad`` the backward accumulated (from
    zero), so both the returned and the accumulated gradients are checked.
    """
    params = list(objective.parameters()) + list(extra)
    names = list(outputs)
    inputs = {**outputs, **{_key(p): p.value.copy() for p in params}}

    def forward(**kw):
        for p in params:
            p.value = kw[_key(p)].copy()
        out = tuple(kw[n] for n in names) if len(names) == 2 else kw[names[0]]
        return objective.forward(out, labels, **forward_kwargs)

    def backward(ctx, d_value):
        for p in params:
            p.zero_grad()
        d_out = objective.backward(ctx, d_value)
        d_out = d_out if isinstance(d_out, tuple) else (d_out,)
        grads = dict(zip(names, d_out))
        grads.update({_key(p): p.grad.copy() for p in params})
        return grads

    result = check_gradients(forward, backward, inputs, mode="full", rng=seed)
    assert_gradients(result, rtol=1e-6, atol=1e-10)
    return result


def _y(seed=1, shape=(8, 5)):
    return np.random.default_rng(seed).standard_normal(shape)


def _z(seed=2, shape=(8, 6)):
    return np.random.default_rng(seed).uniform(0.05, 1.0, shape)


# ------------------------------------------------------------------- gradients (FD)
@pytest.mark.parametrize("loss", sorted(SMOOTH))
@pytest.mark.parametrize("reference", [False, True])
def test_loss_objective_gradients(loss, reference):
    objective = LossObjective(loss, reference=reference, rng=3, **SMOOTH[loss])
    result = _gradcheck(objective, {"y": _y()})
    if objective.is_proxy_loss:
        assert result[_key(objective.proxies)].scale > 0


@pytest.mark.parametrize("base", ["proxy_nca", "contrastive"])
@pytest.mark.parametrize("reference", [False, True])
def test_gsp_objective_gradients(base, reference):
    kwargs = dict(dim=5) if base == "proxy_nca" else SMOOTH["contrastive"]
    objective = GSPObjective(base, lambda_=0.3, n_classes=4, attribute_dim=3,
                             reference=reference, rng=4, base_kwargs=kwargs)
    result = _gradcheck(objective, {"y": _y(), "z": _z()}, split=SPLIT)
    assert result[_key(objective.class_embeddings)].scale > 0
    assert result["z"].scale > 0


@pytest.mark.parametrize("reference", [False, True])
def test_xml_objective_gradients(reference):
    objective = XMLObjective("contrastive", lambda_=0.4, ridge=0.1, reference=reference,
                             base_kwargs=SMOOTH["contrastive"])
    result = _gradcheck(objective, {"y": _y(), "z": _z()}, split=SPLIT)
    assert result["z"].scale > 0 and result["y"].scale > 0


@pytest.mark.parametrize("kind", ["contrastive", "triplet"])
@pytest.mark.parametrize("reference", [False, True])
def test_wasserstein_objective_gradients(kind, reference):
    rng = np.random.default_rng(5)
    features = rng.uniform(-0.5, 0.5, (4, 3, 2))
    objective = WassersteinObjective(kind, margin=20.0, eps=0.5, p=2, reference=reference,
                                     **TIGHT)
    _gradcheck(objective, {"features": features}, labels=np.array([0, 0, 1, 1]))


@pytest.mark.parametrize("base", sorted(ASAP_SMOOTH))
@pytest.mark.parametrize("reference", [False, True])
def test_asap_objective_gradients(base, reference):
    theta = Parameter(_y(6, (3, 2)), "model.weight")
    objective = ASAPObjective(base, n_classes=4, dim=5, proxies_per_class=2, budget=2,
                              lambda_=0.7, model_parameters=[theta], reference=reference,
                              rng=7, **ASAP_SMOOTH[base])
    theta.value = theta.value + _y(8, (3, 2))          # theta != theta*
    result = _gradcheck(objective, {"y": _y()}, extra=[theta])
    assert result[_key(theta)].scale > 0
    assert result[_key(objective.proxies)].scale > 0


@pytest.mark.parametrize("base, loss", [("contrastive", "proxy_contrastive"),
                                        ("multi_similarity", "proxy_multi_similarity")])
def test_asap_pair_bases_are_the_loss_between_samples_and_proxies(base, loss):
    # Eq. (4.11): the pair loss between every proxy and every batch sample, plus the
    # regulariser; the loss's hyperparameters pass through.
    theta = Parameter(np.zeros(3), "w")
    objective = ASAPObjective(base, n_classes=4, dim=5, proxies_per_class=2, budget=3,
                              lambda_=0.5, model_parameters=[theta], rng=0, reference=True,
                              **ASAP_SMOOTH[base])
    assert objective.base.loss_name == loss
    theta.value = np.array([1.0, -2.0, 2.0])
    value, _ = objective.forward(_y(), LABELS)
    expected, _ = getattr(losses, loss)(_y(), LABELS, proxies=objective.proxies.value,
                                        proxy_labels=objective.proxy_labels,
                                        **ASAP_SMOOTH[base])
    assert_allclose(value, expected + 0.25 * 9.0, rtol=1e-13)
    assert_allclose(objective.proxy_labels, np.repeat(np.arange(4), 2), rtol=0)


def test_asap_regulariser_closed_form():
    theta = Parameter(np.zeros(3), "w")
    objective = ASAPObjective("proxy_nca", n_classes=4, dim=5, proxies_per_class=2, budget=3,
                              lambda_=0.5, model_parameters=[theta], rng=0)
    theta.value = np.array([1.0, -2.0, 2.0])
    value, ctx = objective.forward(_y(), LABELS)
    loss, _ = proxy_nca(_y(), LABELS, proxies=objective.proxies.value,
                        proxy_labels=objective.proxy_labels)
    assert_allclose(value, loss + 0.25 * 9.0, rtol=1e-13)
    objective.backward(ctx, 2.0)
    assert_allclose(theta.grad, 2.0 * 0.5 * theta.value, rtol=1e-15)


def test_gsp_objective_is_the_convex_mix():
    objective = GSPObjective("proxy_nca", lambda_=0.1, n_classes=4, attribute_dim=3, rng=0,
                             base_kwargs=dict(dim=5), reference=True)
    value, _ = objective.forward((_y(), _z()), LABELS, split=SPLIT)
    dml, _ = proxy_nca(_y(), LABELS, proxies=objective.base.proxies.value,
                       proxy_labels=objective.base.proxy_labels)
    zsr, _ = zero_shot_loss(_z(), LABELS, objective.class_embeddings.value, ridge=0.05,
                            scale=9.5, split=SPLIT)
    assert_allclose(value, 0.9 * dml + 0.1 * zsr, rtol=1e-14)


# ------------------------------------------------------- fast path vs reference (float64)
def _run(objective, outputs, labels=LABELS, d_value=1.7):
    objective.zero_grad()
    value, ctx = objective.forward(outputs, labels)
    d_out = objective.backward(ctx, d_value)
    d_out = d_out if isinstance(d_out, tuple) else (d_out,)
    grads = [p.grad.copy() for p in objective.parameters()]
    return value, [d for d in d_out if d is not None], grads


def _builders():
    yield "contrastive", lambda ref: LossObjective("contrastive", reference=ref), None
    yield "multi_similarity", lambda ref: LossObjective("multi_similarity", reference=ref), None
    for loss in ("proxy_nca", "proxy_anchor", "soft_triple"):
        yield loss, (lambda ref, loss=loss: LossObjective(loss, reference=ref, rng=1,
                                                          **SMOOTH[loss])), None
    # rng=1 would draw the proxies as _y()'s rows: every sample on a proxy of its class, at
    # the distance's kink (d = 0 up to rounding), where the two paths' subgradients differ.
    for loss in ("proxy_contrastive", "proxy_multi_similarity"):
        yield loss, (lambda ref, loss=loss: LossObjective(loss, reference=ref, rng=2,
                                                          **SMOOTH[loss])), None
    yield "gsp", lambda ref: GSPObjective("proxy_nca", n_classes=4, attribute_dim=3, rng=2,
                                          reference=ref, base_kwargs=dict(dim=5)), "pair"
    yield "xml", lambda ref: XMLObjective("triplet", lambda_=0.5, ridge=0.05, rng=3,
                                          reference=ref), "pair"
    yield "wasserstein", lambda ref: WassersteinObjective("contrastive", margin=1.0, eps=0.5,
                                                          reference=ref, **TIGHT), "local"
    yield "asap", lambda ref: ASAPObjective(n_classes=4, dim=5, proxies_per_class=2, budget=2,
                                            lambda_=0.1, rng=4, reference=ref), None
    yield "asap_contrastive", lambda ref: ASAPObjective(
        "contrastive", n_classes=4, dim=5, proxies_per_class=2, budget=2, lambda_=0.1, rng=4,
        reference=ref, neg_margin=1.2), None


@pytest.mark.parametrize("name, build, kind", list(_builders()), ids=[b[0] for b in _builders()])
def test_fast_path_matches_reference_float64(name, build, kind):
    outputs = {None: _y(), "pair": (_y(), _z()), "local": _y(9, (8, 3, 2))}[kind]
    fast, reference = build(False), build(True)
    for _ in range(2):                          # the second forward draws a new split
        v_fast, d_fast, g_fast = _run(fast, outputs)
        v_ref, d_ref, g_ref = _run(reference, outputs)
        assert_allclose(v_fast, v_ref, rtol=1e-10)
        assert len(d_fast) == len(d_ref) and len(g_fast) == len(g_ref)
        for a, b in zip(d_fast + g_fast, d_ref + g_ref):
            assert a.dtype == np.float64
            assert_allclose(a, b, rtol=1e-10, atol=1e-12 * np.abs(b).max())


def test_float32_keeps_dtype():
    objective = GSPObjective("proxy_nca", n_classes=4, attribute_dim=3, rng=2,
                             base_kwargs=dict(dim=5), dtype=np.float32)
    y, z = _y().astype(np.float32), _z().astype(np.float32)
    _, d_out, grads = _run(objective, (y, z))
    assert all(a.dtype == np.float32 for a in d_out + grads)


# ------------------------------------------------------------------------ ASAP Alg. 2
def test_asap_reinitialisation_is_select_proxies():
    theta = Parameter(np.ones(4), "w")
    objective = ASAPObjective("proxy_anchor", n_classes=4, dim=5, proxies_per_class=2, budget=3,
                              lambda_=0.1, model_parameters=[theta], rng=0)
    rng = np.random.default_rng(10)
    embeddings, labels = rng.standard_normal((40, 5)), np.repeat(np.arange(4), 10)
    before = objective.proxies.value.copy()
    expected = select_proxies(embeddings, labels, before, objective.proxy_labels, budget=3,
                              rng=11)
    theta.value = theta.value * 3.0
    selection = objective.new_problem_instance(embeddings, labels, rng=11)
    assert_allclose(selection.indices, expected.indices, rtol=0)
    assert_allclose(objective.proxies.value, expected.proxies, rtol=0)
    assert np.all(labels[selection.indices] == objective.proxy_labels)
    assert_allclose(objective.theta_star[0], theta.value, rtol=0)      # theta* <- theta
    value, _ = objective.forward(embeddings[:8], labels[:8])
    assert objective.regularizer()[0] == 0.0
    loss, _ = objective.base.loss_forward(embeddings[:8], labels[:8])
    assert_allclose(value, loss, rtol=0)


def test_state_dicts_round_trip():
    theta = Parameter(np.zeros(2), "w")
    asap = ASAPObjective(n_classes=2, dim=3, proxies_per_class=1, budget=1, lambda_=1.0,
                         model_parameters=[theta], rng=0)
    state = asap.state_dict()
    theta.value = theta.value + 1.0
    asap.new_problem_instance(np.eye(3)[:2], np.array([0, 1]), rng=0)
    asap.load_state_dict(state)
    assert_allclose(asap.regularizer()[0], 1.0, rtol=1e-15)
    xml = XMLObjective(lambda_=1.0, ridge=0.1, rng=5)
    state = xml.state_dict()
    first, _ = xml.forward((_y(), _z()), LABELS)
    xml.load_state_dict(state)
    again, _ = xml.forward((_y(), _z()), LABELS)
    assert again == first


# ------------------------------------------------------------------------ named errors
@pytest.mark.parametrize("build, error, match", [
    (lambda: LossObjective("nope"), ValueError, "loss == 'nope'"),
    (lambda: LossObjective(3), TypeError, "loss must be"),
    (lambda: LossObjective("contrastive", margin=1.0), TypeError, "'margin' is not a hyper"),
    (lambda: LossObjective("proxy_nca", dim=3), ValueError, "n_classes is required"),
    (lambda: LossObjective("proxy_nca", n_classes=0, dim=3), ValueError, "n_classes == 0"),
    (lambda: LossObjective("contrastive", n_classes=3), ValueError, "n_classes is for proxy"),
    (lambda: LossObjective("proxy_nca", n_classes=2, dim=3, proxies=None), TypeError,
     "supplied by the objective"),
    (lambda: LossObjective("triplet", reference=1), TypeError, "reference must be a bool"),
    (lambda: GSPObjective("contrastive", lambda_=1.5, n_classes=2, attribute_dim=2),
     ValueError, "lambda_"),
    (lambda: GSPObjective(3, n_classes=2, attribute_dim=2), TypeError, "base must be"),
    (lambda: GSPObjective("contrastive", n_classes=2, attribute_dim=0), ValueError,
     "attribute_dim == 0"),
    (lambda: XMLObjective("proxy_nca", lambda_=0.5, ridge=0.1), ValueError, "without proxies"),
    (lambda: XMLObjective(lambda_=0.5, ridge=0.0), ValueError, "ridge"),
    (lambda: WassersteinObjective("pairs", margin=1.0, eps=0.5), ValueError, "kind"),
    (lambda: WassersteinObjective(margin=1.0, eps=0.0), ValueError, "eps"),
    (lambda: ASAPObjective("soft_triple", n_classes=2, dim=2, proxies_per_class=1, budget=1,
                           lambda_=0.1), ValueError, "base"),
    (lambda: ASAPObjective(n_classes=2, dim=2, proxies_per_class=3, budget=2, lambda_=0.1),
     ValueError, "budget == 2"),
    (lambda: ASAPObjective(n_classes=2, dim=2, proxies_per_class=1, budget=2, lambda_=-1.0),
     ValueError, "lambda_"),
    (lambda: ASAPObjective(n_classes=2, dim=2, proxies_per_class=1, budget=2, lambda_=0.1,
                           model_parameters=[np.zeros(2)]), TypeError, "Parameter"),
])
def test_bad_arguments_are_named(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_bad_forward_and_backward_inputs_are_named():
    objective = LossObjective("proxy_nca", n_classes=4, dim=5, rng=0)
    value, ctx = objective.forward(_y(), LABELS)
    other = LossObjective("proxy_nca", n_classes=4, dim=5, rng=0)
    with pytest.raises(TypeError, match="ctx"):
        objective.backward(object())
    with pytest.raises(ValueError, match=r"ctx was returned by the forward of another object"):
        other.backward(ctx)
    with pytest.raises(ValueError, match="d_value"):
        objective.backward(ctx, float("nan"))
    with pytest.raises(ValueError, match="d_value"):
        objective.backward(ctx, np.ones(2))
    with pytest.raises(TypeError, match="d_value"):
        objective.backward(ctx, "1")
    gsp = GSPObjective("contrastive", n_classes=4, attribute_dim=2)
    with pytest.raises(TypeError, match=r"pair \(y, z\)"):
        gsp.forward(_y(), LABELS)
    wasserstein = WassersteinObjective(margin=1.0, eps=0.5)
    with pytest.raises(ValueError, match="ends before pooling"):
        wasserstein.forward(_y(), LABELS)
    assert isinstance(ctx, ObjectiveContext)


def test_loss_objective_ignores_z():
    objective = LossObjective("contrastive")
    _, ctx = objective.forward((_y(), _z()), LABELS)
    d_y, d_z = objective.backward(ctx)
    assert d_z is None and d_y.shape == (8, 5)


def test_config_is_plain_json_without_object_addresses():
    import json

    from refdml.train.objectives import GSPObjective, LossObjective

    for objective in (GSPObjective("contrastive", n_classes=4, attribute_dim=8, rng=1),
                      LossObjective("proxy_nca", n_classes=4, dim=8, rng=1, temperature=0.2)):
        text = json.dumps(objective.config())
        assert " at 0x" not in text and "Generator" not in text
    # Equal for an equal objective (the seed is state, not configuration), different for
    # another hyperparameter.
    a = LossObjective("proxy_nca", n_classes=4, dim=8, rng=1, temperature=0.2).config()
    b = LossObjective("proxy_nca", n_classes=4, dim=8, rng=2, temperature=0.2).config()
    c = LossObjective("proxy_nca", n_classes=4, dim=8, rng=1, temperature=0.3).config()
    assert a == b and a != c


# ------------------------------------------------------------- built from a config
def test_build_objective_proxy_is_the_loss_against_one_proxy_per_class():
    from refdml.train.models import ObjectiveConfig, Placement, build_objective

    placement = Placement(dtype=np.float64, reference=True)
    proxy = build_objective(ObjectiveConfig(kind="proxy", loss="contrastive", embedding_dim=5,
                                            neg_margin=1.2), 4, rng=0, placement=placement)
    assert isinstance(proxy, LossObjective) and proxy.loss_name == "proxy_contrastive"
    assert proxy.proxies.shape == (4, 5) and proxy.hyperparameters == {"neg_margin": 1.2}
    assert_allclose(proxy.proxy_labels, np.arange(4), rtol=0)
    assert list(proxy.parameters()) == [proxy.proxies]      # no regulariser, no theta*
    ms = build_objective(ObjectiveConfig(kind="proxy", loss="multi_similarity",
                                         embedding_dim=5), 4, rng=0, placement=placement)
    assert ms.loss_name == "proxy_multi_similarity"
    nca = build_objective(ObjectiveConfig(kind="proxy", loss="proxy_nca", embedding_dim=5), 4,
                          rng=0, placement=placement)
    assert nca.loss_name == "proxy_nca"
    with pytest.raises(ValueError, match="loss == 'triplet'"):
        build_objective(ObjectiveConfig(kind="proxy", loss="triplet", embedding_dim=5), 4,
                        rng=0, placement=placement)
    theta = Parameter(np.zeros(2), "w")
    asap = build_objective(ObjectiveConfig(kind="asap", loss="contrastive", embedding_dim=5,
                                           proxies_per_class=2, budget=3, asap_lambda=0.1,
                                           pos_margin=0.1), 4, rng=0, placement=placement,
                           model_parameters=[theta])
    assert isinstance(asap, ASAPObjective) and asap.base.loss_name == "proxy_contrastive"
    assert asap.base.hyperparameters == {"pos_margin": 0.1}
    assert asap.model_parameters == [theta]
