"""Every head and objective of issue 12, trained as a whole model: the float64 reference
path against the fast path after 20 Adam steps (to 1e-8 relative), and one finite-difference
check of the gradient of EVERY parameter (model and objective together) per case.

Cases (tokens in, small sizes): GAP, GMP, GeMean heads with a pair loss and two proxy
losses; the GSP head with GSP's zero-shot regulariser (GSP Alg. 1); the XML histogram head
with the XML loss (Eqs. 2.10-2.11, a two-branch model: GAP embeddings and histograms of the
same local features); the Wasserstein contrastive loss on local features; ASAP (several
proxies per class, the projection regulariser on the model's parameters, a new problem
instance at steps 0 and 10). The conv layers (the same code on both paths) are covered by the
digits-collage cross-check in tests/train/test_train_runs.py.

CPU vs GPU: :func:`test_cpu_and_gpu_trajectories_agree` runs the same 20 steps on CuPy and
compares them with NumPy (to :data:`TRAJECTORY_RTOL` of each dtype, and ASAP's proxy picks
exactly where their leads certify them); it skips (marker ``requires_cupy``) where there is
neither a GPU nor the CuPy stand-in under the simulator.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

import refdml.kcenter
from _kcenter_checks import pick_leads
from refdml._backend import to_numpy
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.train import Adam
from refdml.train.layers import (
    GAP,
    GMP,
    Embedding,
    GeMean,
    GSPHead,
    L2Normalize,
    Linear,
    ReLU,
    Sequential,
    XMLHistogramHead,
)
from refdml.train.objectives import (
    ASAPObjective,
    GSPObjective,
    LossObjective,
    WassersteinObjective,
    XMLObjective,
)

N_TOKENS, DIM, EMB, N_CLASSES = 12, 4, 3, 4
CONTRASTIVE = dict(pos_margin=0.0, neg_margin=2.5)     # every negative hinge active
# The fast path on a GPU against the fast path on NumPy float64 after 20 Adam steps, relative
# to each parameter's largest entry. float64: the devices differ per step by at most the
# kernels' parity tolerances (1e-10 and below: FMA, reduction order), which Adam's
# normalised update passes on about one for one: 20 x 1e-10, with a factor 5 to spare, is
# 1e-8 (the budget of the reference-vs-fast check too). float32: the float32 run's own
# error against float64, its parity tolerances (2e-5 per step) over the same 20 steps:
# 4e-4, with a factor 2.5 to spare.
TRAJECTORY_RTOL = {np.float64: 1e-8, np.float32: 1e-3}


class TwoBranch:
    """``x -> f = trunk(x) -> (y_branch(f), z_branch(f))``: GAP embeddings and XML
    histograms of the same local features (XML's model). Backward sums the two branches'
    gradients of ``f``."""

    def __init__(self, trunk, y_branch, z_branch):
        self.parts = (trunk, y_branch, z_branch)

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def named_parameters(self):
        for part in self.parts:
            yield from part.named_parameters()

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()

    def forward(self, x):
        trunk, y_branch, z_branch = self.parts
        f, c0 = trunk.forward(x)
        y, c1 = y_branch.forward(f)
        z, c2 = z_branch.forward(f)
        return (y, z), (c0, c1, c2)

    def backward(self, ctx, d_out):
        trunk, y_branch, z_branch = self.parts
        (c0, c1, c2), (d_y, d_z) = ctx, d_out
        d_f = y_branch.backward(c1, d_y)
        if d_z is not None:
            d_f = d_f + z_branch.backward(c2, d_z)
        return trunk.backward(c0, d_f)


def _tail(d, reference, dtype, device):
    return [Linear(d, EMB, rng=2, dtype=dtype, device=device),
            L2Normalize(reference=reference)]


def _embedding(dtype, device, *, positive=False):
    layer = Embedding(N_TOKENS, DIM, rng=0, dtype=dtype, device=device)
    if positive:   # GeMean needs non-negative features; away from the ReLU's kink
        layer.table.value = abs(layer.table.value) + 0.1
    return layer


def build(case, reference, dtype=np.float64, device="cpu"):
    """``(model, objective)`` of a case; the same seeds on both paths."""
    kw = dict(reference=reference, dtype=dtype, device=device)
    if case in ("gap-contrastive", "gmp-proxy_nca", "gemean-proxy_anchor", "asap"):
        pool = {"gap-contrastive": GAP(), "gmp-proxy_nca": GMP(),
                "gemean-proxy_anchor": GeMean(p=3.0), "asap": GAP()}[case]
        layers = [_embedding(dtype, device, positive=case.startswith("gemean"))]
        if case.startswith("gemean"):
            layers.append(ReLU())
        model = Sequential([*layers, pool, *_tail(DIM, reference, dtype, device)])
        if case == "gap-contrastive":
            objective = LossObjective("contrastive", **CONTRASTIVE, **kw)
        elif case == "asap":
            objective = ASAPObjective("proxy_nca", n_classes=N_CLASSES, dim=EMB,
                                      proxies_per_class=2, budget=3, lambda_=0.3,
                                      model_parameters=list(model.parameters()), rng=5, **kw)
        else:
            loss = case.split("-")[1]
            extra = dict(alpha=4.0) if loss == "proxy_anchor" else {}
            objective = LossObjective(loss, n_classes=N_CLASSES, dim=EMB, rng=5, **extra, **kw)
        return model, objective
    if case == "gsp-zsr":
        model = Sequential([_embedding(dtype, device),
                            GSPHead(5, DIM, mu=0.4, inverse_temperature=3.0, rng=1, **kw),
                            *_tail(DIM, reference, dtype, device)])
        objective = GSPObjective("contrastive", lambda_=0.3, ridge=0.05, n_classes=N_CLASSES,
                                 attribute_dim=EMB, rng=5, base_kwargs=CONTRASTIVE, **kw)
        return model, objective
    if case == "xml":
        model = TwoBranch(Sequential([_embedding(dtype, device)], name="trunk"),
                          Sequential([GAP(), *_tail(DIM, reference, dtype, device)],
                                     name="ybranch"),
                          Sequential([XMLHistogramHead(5, DIM, inverse_temperature=2.0, rng=1,
                                                       **kw)], name="zbranch"))
        objective = XMLObjective("contrastive", lambda_=0.4, ridge=0.1, rng=5,
                                 base_kwargs=CONTRASTIVE, reference=reference)
        return model, objective
    if case == "wasserstein":
        # The ReLU makes the bias matter: the Wasserstein distance is blind to a common
        # shift of all local features, so without it the bias's gradient is rounding noise
        # that Adam scales up to lr.
        model = Sequential([_embedding(dtype, device),
                            Linear(DIM, EMB, rng=2, dtype=dtype, device=device), ReLU()])
        objective = WassersteinObjective("contrastive", margin=2.0, eps=0.5, p=2, tol=1e-13,
                                         max_iter=5000, reference=reference)
        return model, objective
    raise AssertionError(case)


CASES = ["gap-contrastive", "gmp-proxy_nca", "gemean-proxy_anchor", "gsp-zsr", "xml",
         "wasserstein", "asap"]


def _data(seed=0, n_per_class=2, n_positions=5):
    """A batch of token samples, no two with the same multiset of tokens: two equal
    samples have equal embeddings, where a distance's gradient ``(x_i - x_j) / d_ij`` is
    rounding noise on either path (a kink, not a disagreement)."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(N_CLASSES), n_per_class)
    while True:
        # Class c favours tokens 3c .. 3c+2, so that training has something to learn.
        tokens = np.where(rng.random((labels.size, n_positions)) < 0.6,
                          3 * labels[:, None] + rng.integers(0, 3, (labels.size, n_positions)),
                          rng.integers(0, N_TOKENS, (labels.size, n_positions)))
        if np.unique(np.sort(tokens, axis=1), axis=0).shape[0] == labels.size:
            return tokens, labels


def _params(model, objective):
    return [*model.parameters(), *objective.parameters()]


def _train(case, reference, n_steps=20, dtype=np.float64, device="cpu", xp=np):
    """``n_steps`` Adam steps (lr 1e-2) on fresh batches; the parameter values on the host."""
    model, objective = build(case, reference, dtype, device)
    optimizer = Adam(_params(model, objective), lr=1e-2)
    start = {p.name: np.array(to_numpy(p.value), copy=True) for p in optimizer.params}
    for step in range(n_steps):
        tokens, labels = _data(step)
        if case == "asap" and step % 10 == 0:
            # Alg. 1's outer step, with the same pool draws on both paths.
            embeddings, _ = model.forward(xp.asarray(_data(100 + step, 4)[0]))
            objective.new_problem_instance(embeddings, _data(100 + step, 4)[1],
                                           np.random.default_rng(step))
            optimizer.reset_state(list(objective.parameters()))
        outputs, ctx = model.forward(xp.asarray(tokens))
        _, octx = objective.forward(outputs, xp.asarray(labels))
        model.backward(ctx, objective.backward(octx, 1.0))
        optimizer.step()
        optimizer.zero_grad()
    return start, {p.name: np.array(to_numpy(p.value), copy=True) for p in optimizer.params}


def _assert_trajectories_agree(a, b, rtol, start):
    assert set(a) == set(b)
    moved = 0.0
    for name in a:
        scale = np.abs(b[name]).max()
        assert_allclose(a[name], b[name], rtol=0, atol=rtol * scale, err_msg=name)
        moved = max(moved, np.abs(b[name] - start[name]).max() / max(scale, 1e-300))
    assert moved > 1e-2, "the parameters barely moved: the comparison would be vacuous"


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_fast_path_after_20_steps(case):
    start, fast = _train(case, reference=False)
    _, ref = _train(case, reference=True)
    _assert_trajectories_agree(fast, ref, 1e-8, start)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reference", [False, True])
def test_whole_model_gradient_every_parameter(case, reference):
    """FD of the objective's value w.r.t. every parameter of the model AND the objective."""
    model, objective = build(case, reference)
    tokens, labels = _data(7)
    if case == "asap":   # theta* != theta, so the regulariser's gradient is not zero
        objective.new_problem_instance(model.forward(tokens)[0], labels,
                                       np.random.default_rng(0))
        for p in model.parameters():
            p.value = p.value + 0.05 * np.random.default_rng(1).standard_normal(p.shape)
    params = {p.name: p for p in _params(model, objective)}
    split = {"split": np.isin(labels, [0, 2])} if case in ("gsp-zsr", "xml") else {}

    def forward(**values):
        for name, value in values.items():
            params[name].value = value
        outputs, ctx = model.forward(tokens)
        value, octx = objective.forward(outputs, labels, **split)
        return value, (ctx, octx)

    def backward(ctx, d_value):
        model_ctx, octx = ctx
        for p in params.values():
            p.zero_grad()
        model.backward(model_ctx, objective.backward(octx, d_value))
        return {name: p.grad.copy() for name, p in params.items()}

    inputs = {name: p.value.copy() for name, p in params.items()}
    result = check_gradients(forward, backward, inputs, mode="vjp", rng=3)
    assert {c.name for c in result.checks} == set(params)
    assert_gradients(result, rtol=1e-6, atol=1e-10)


def _record_proxy_picks(monkeypatch) -> list:
    """Record every greedy k-center traversal of ASAP's proxy selection (Alg. 2, on the
    host in float64): ``(points, initial, picks)``."""
    calls = []
    real = refdml.kcenter.greedy_k_center

    def recorded(points, k, *, initial=None, **kwargs):
        result = real(points, k, initial=initial, **kwargs)
        calls.append((np.array(points, dtype=np.float64), np.array(initial, dtype=np.float64),
                      result.indices.tolist()))
        return result

    monkeypatch.setattr(refdml.kcenter, "greedy_k_center", recorded)
    return calls


def _assert_same_proxy_picks(got, want):
    """The device run's proxy picks are the CPU run's wherever the CPU traversal's leads
    exceed four times the largest move of a point or centre between the runs (the
    certificate of tests/_kcenter_checks.pick_leads); a pick is a discrete output, and a
    different one would part the trajectories for good."""
    assert len(got) == len(want)
    for (points, initial, picks), (points0, initial0, picks0) in zip(got, want):
        delta = max(np.max(np.linalg.norm(points - points0, axis=1)),
                    np.max(np.linalg.norm(initial - initial0, axis=1)))
        lead = float(np.min(pick_leads(points0, len(picks0), initial0)))
        assert lead > 4 * delta, (
            f"proxy picks not certified: lead {lead:.3g} <= 4 x {delta:.3g}; pick another seed")
        assert picks == picks0


@pytest.mark.requires_cupy
@pytest.mark.parametrize("case", CASES)
def test_cpu_and_gpu_trajectories_agree(case, monkeypatch):
    """The fast path on CuPy vs NumPy after 20 steps, to TRAJECTORY_RTOL of each dtype."""
    import cupy

    picks = _record_proxy_picks(monkeypatch)
    start, cpu = _train(case, reference=False)
    cpu_picks = list(picks)
    assert bool(cpu_picks) == (case == "asap")
    for dtype in (np.float64, np.float32):
        picks.clear()
        _, gpu = _train(case, reference=False, dtype=dtype, device="cuda", xp=cupy)
        _assert_same_proxy_picks(picks, cpu_picks)
        _assert_trajectories_agree(gpu, cpu, TRAJECTORY_RTOL[dtype], start)
