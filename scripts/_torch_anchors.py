r"""PyTorch anchors of scripts/bench_gpu.py: what a user would run instead of refdml.

Three pieces, each written from the papers' mathematics (nothing copied from elsewhere),
on any torch device and dtype:

- :func:`gsp_pool`: the GSP pooling layer (GSP Sec. 4.1-4.2, Alg. 2-3) as its authors
  describe it: the entropic partial transport (P2) solved by ``n_iter`` fixed-point
  iterations of Prop. 4.2 (plain ``exp``, as printed), inside a custom
  :class:`torch.autograd.Function` (:class:`WeightTransport`) whose backward is the closed
  form of Prop. 4.3; the cost map and the pooling are differentiated by autograd.
- :func:`retrieval_metrics`: P@1, R-precision and MAP@R by blocked ``torch.matmul`` of the
  queries against the references and ``torch.topk`` (refdml.metrics' definitions).
- :func:`gsp_objective` and :func:`collage_twin`: the digits-collage training step with
  every piece in PyTorch (the GSP head by :func:`gsp_pool`, GSP Alg. 1's objective
  ``(1 - lambda) contrastive + lambda ZSR`` in torch), on scripts/_torch_twin.py's model.

Needs ``torch`` (no dependency of refdml): bench_gpu imports this module only where torch
is importable, and reports its rows as skipped otherwise.

Shapes: ``B`` images, ``n`` features per image, ``m`` prototypes, ``d`` channels;
features ``(B, n, d)``, prototypes ``(m, d)``, cost ``(B, m, n)``, rho ``(B, n)``, pi
``(B, m, n)``. ``inverse_temperature`` is the paper's ε (varepsilon).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "WeightTransport",
    "clip_to_unit_ball",
    "collage_twin",
    "contrastive_loss",
    "cost_map",
    "gsp_objective",
    "gsp_pool",
    "retrieval_metrics",
    "use_full_float32",
    "weight_transport_iterations",
    "zero_shot_loss",
]

#: Fixed-point iterations of Prop. 4.2: the GSP paper's k (Sec. 5, supp. 1.5).
N_ITER = 100
#: References per block of the retrieval's score matrix (as refdml's bench section).
RETRIEVAL_BLOCK = 16384


def use_full_float32() -> dict:
    """Make float32 convolutions and matrix products full IEEE float32 (no TF32), as
    refdml's float32 is; returns the previous settings. PyTorch's default lets cuDNN run
    float32 convolutions in TF32 (10-bit mantissa) on a GPU; its matrix products are
    already IEEE by default."""
    cudnn_conv = getattr(torch.backends.cudnn, "conv", None)
    if cudnn_conv is not None and hasattr(cudnn_conv, "fp32_precision"):
        before = {"cudnn.conv": cudnn_conv.fp32_precision,
                  "cuda.matmul": torch.backends.cuda.matmul.fp32_precision}
        cudnn_conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:                                                   # torch before the new API
        before = {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                  "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32}
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return before


# =========================================================================== GSP layer
def clip_to_unit_ball(u: torch.Tensor) -> torch.Tensor:
    r"""``ubar = u / max(1, ||u||_2)`` over the last axis (GSP Sec. 4.1): rows inside the
    unit ball are kept, rows outside are projected onto the sphere."""
    return u / torch.clamp(torch.linalg.vector_norm(u, dim=-1, keepdim=True), min=1.0)


def cost_map(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    r"""The cost ``c_ij = || wbar_i - fbar_j ||_2`` (GSP Sec. 4.1, Alg. 2), ``(B, m, n)``,
    from features ``(B, n, d)`` and prototypes ``(m, d)`` clipped to the unit ball.

    ``torch.cdist`` is what a PyTorch user reaches for; its backward gives 0 at a zero
    distance (the subgradient refdml takes too).
    """
    w = clip_to_unit_ball(prototypes)
    f = clip_to_unit_ball(features)
    return torch.cdist(w.expand(f.shape[0], *w.shape), f)


def weight_transport_iterations(cost: torch.Tensor, mu: float, inverse_temperature: float,
                                n_iter: int = N_ITER) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(rho, pi)`` after ``n_iter`` fixed-point iterations of GSP Prop. 4.2 (Alg. 3).

    (P2) is the entropic partial transport

    .. math::
        \min_{\rho, \pi \ge 0} \sum_{ij} c_{ij}\pi_{ij}
            + \tfrac1\varepsilon \Big(\sum_{ij}\pi_{ij}\log\pi_{ij}
                                      + \sum_j \rho_j\log\rho_j\Big)
        \quad\text{s.t.}\quad \rho_j + \textstyle\sum_i \pi_{ij} = 1/n,\;
        \textstyle\sum_{ij}\pi_{ij} = \mu .

    Its stationarity conditions give ``pi = t exp(-ε c) Diag(rho)`` with a scalar ``t`` per
    image; with ``kappa = exp(-ε c)`` and ``s = kappa^T 1_m`` (column sums, ``(B, n)``),
    Prop. 4.2 alternates, from ``t = 1``,

    .. math::
        \rho \leftarrow \tfrac1n (1 + t s)^{-1}, \qquad
        t \leftarrow \mu \,/\, (s^\top \rho),

    the first enforcing the column constraints, the second the mass. Written with plain
    ``exp`` as printed: right where ``exp(-ε c)`` neither underflows nor overflows, which is
    the case of the benchmark (``ε c <= 10``); refdml's log-domain solver has no such limit.
    Plain tensor operations: autograd can differentiate through the iterations
    (:func:`gsp_pool` with ``backward="unrolled"``), and :class:`WeightTransport` runs the
    same function without a graph.

    cost ``(B, m, n)`` -> rho ``(B, n)``, pi ``(B, m, n)``.
    """
    n = cost.shape[-1]
    kappa = torch.exp(-inverse_temperature * cost)
    s = kappa.sum(dim=1)                                        # (B, n)
    t = torch.ones(cost.shape[0], 1, dtype=cost.dtype, device=cost.device)
    rho = None
    for _ in range(n_iter):
        rho = (1.0 / n) / (1.0 + t * s)
        t = mu / (s * rho).sum(dim=1, keepdim=True)
    pi = t[:, :, None] * kappa * rho[:, None, :]
    return rho, pi


class WeightTransport(torch.autograd.Function):
    r"""``(rho, pi)`` of (P2) by :func:`weight_transport_iterations`, with the closed-form
    backward of GSP Prop. 4.3.

    **Backward (implicit differentiation at the solution).** Write
    ``l_j = log sum_i exp(-ε c_ij)``, ``A_ij = exp(-ε c_ij - l_j)`` (each column a softmax),
    ``tau = log t`` and ``sigma_j = sigma(tau + l_j)``. The stationarity conditions give
    ``rho_j = (1 - sigma_j) / n``, ``P_j := sum_i pi_ij = sigma_j / n`` and
    ``pi_ij = P_j A_ij``; the mass constraint is ``g(tau) = sum_j sigma_j = n mu``. A change
    of cost moves ``l`` (``dl_j = -ε sum_i A_ij dc_ij``), ``A``
    (``dA_ij = A_ij (-ε dc_ij - dl_j)``) and, through the constraint, ``tau``
    (``dtau = -sum_j sigma'_j dl_j / S`` with ``sigma'_j = sigma_j (1 - sigma_j)``,
    ``S = sum_j sigma'_j``). Collecting ``dL = <d_rho, drho> + <d_pi, dpi>`` with
    ``a_j = sum_i A_ij d_pi_ij`` and ``b = a - d_rho``:

    .. math::
        \frac{\partial L}{\partial c_{ij}} = -\varepsilon\Big(\pi_{ij}(\bar\pi_{ij} - a_j)
            + n\,\pi_{ij}\rho_j (b_j - \bar b)\Big), \qquad
        \bar b = \frac{\sum_k \sigma'_k b_k}{S},

    and with ``sigma'_j / n = n rho_j P_j``, ``S / n = 1 - mu - n rho^T rho`` this is the
    paper's Eq. (4.2),

    .. math::
        \frac{\partial L}{\partial c} = -\varepsilon\Big(\pi \odot \bar\pi
            - n\,\pi\,\mathrm{Diag}\big(q - \tfrac{\eta}{1 - \mu - n\rho^\top\rho}\,\rho\big)\Big),
        \quad q = \rho\odot\bar\rho + (\pi\odot\bar\pi)^\top 1_m,\;
        \eta = (\rho\odot\bar\rho)^\top 1_n - n\, q^\top\rho,

    read with ``rho`` inside the ``Diag`` (multiplying ``eta / kappa``): the printed
    ``Diag(...) rho`` would be a vector, not an ``(m, n)`` gradient (refdml's docs/gsp.md,
    "Reading of (4.2)"). That form is evaluated here, on the last iterate, as the authors'
    Alg. 3 does; it is exact at the solution and off by the order of the iterate's residual
    elsewhere. ``bar`` denotes the upstream gradient.

    ``apply(cost (B, m, n), mu, inverse_temperature, n_iter)`` -> rho ``(B, n)``, pi
    ``(B, m, n)``.
    """

    @staticmethod
    def forward(ctx, cost, mu, inverse_temperature, n_iter):
        rho, pi = weight_transport_iterations(cost, mu, inverse_temperature, n_iter)
        ctx.save_for_backward(rho, pi)
        ctx.mu, ctx.inverse_temperature = mu, inverse_temperature
        return rho, pi

    @staticmethod
    def backward(ctx, d_rho, d_pi):
        rho, pi = ctx.saved_tensors
        n = rho.shape[-1]
        rho_d_rho = rho * d_rho                                             # (B, n)
        q = rho_d_rho + (pi * d_pi).sum(dim=1)                              # (B, n)
        eta = rho_d_rho.sum(dim=1, keepdim=True) - n * (q * rho).sum(dim=1, keepdim=True)
        kappa = 1.0 - ctx.mu - n * (rho * rho).sum(dim=1, keepdim=True)     # (B, 1)
        column = q - (eta / kappa) * rho                                    # (B, n)
        d_cost = -ctx.inverse_temperature * (pi * d_pi - n * pi * column[:, None, :])
        return d_cost, None, None, None


def gsp_pool(features: torch.Tensor, prototypes: torch.Tensor, *, mu: float,
             inverse_temperature: float, n_iter: int = N_ITER,
             backward: str = "closed_form") -> tuple[torch.Tensor, torch.Tensor]:
    r"""The GSP pooling layer (GSP Alg. 2 with p = 1): ``(pooled (B, d), z (B, m))``.

    With ``(rho, pi)`` from (P2) on :func:`cost_map` and the pooling weights
    ``w_j = (1 - n rho_j) / mu`` (Eq. 4.1, ``(1/n - rho_j) / mu`` per feature, times n):

    .. math::
        \text{pooled} = \frac1n \sum_j w_j f_j, \qquad z_i = \frac1\mu \sum_j \pi_{ij}
        \quad\text{(Eq. 4.3)},

    the weights applied to the raw features (only the cost sees the clipped ones), as
    refdml's ``gsp_pool_forward`` with ``p = 1``. ``backward``: ``"closed_form"``
    (:class:`WeightTransport`, Prop. 4.3) or ``"unrolled"`` (autograd through the
    ``n_iter`` iterations; a check, and what Fig. 7 of the paper compares against).
    """
    cost = cost_map(features, prototypes)
    if backward == "closed_form":
        rho, pi = WeightTransport.apply(cost, mu, inverse_temperature, n_iter)
    elif backward == "unrolled":
        rho, pi = weight_transport_iterations(cost, mu, inverse_temperature, n_iter)
    else:
        raise ValueError(f"backward == {backward!r}, must be 'closed_form' or 'unrolled'")
    n = features.shape[1]
    weights = (1.0 - n * rho) / mu                                          # (B, n)
    pooled = (weights[:, :, None] * features).mean(dim=1)
    z = pi.sum(dim=2) / mu
    return pooled, z


# =========================================================================== retrieval
def retrieval_metrics(query: torch.Tensor, query_labels: torch.Tensor,
                      reference: torch.Tensor, reference_labels: torch.Tensor, *,
                      block: int = RETRIEVAL_BLOCK) -> dict:
    r"""P@1, R-precision and MAP@R of ``query`` against ``reference`` (Euclidean), the
    definitions of refdml.metrics (Musgrave et al. 2020, pytorch-metric-learning's MAP@R).

    For query ``i`` with ``R_i`` references of its class and ``c_i(j) = 1`` when its
    ``j``-th nearest reference is of its class:

    .. math::
        \mathrm{P@1} = c_i(1), \quad
        \mathrm{RP} = \frac1{R_i}\sum_{j\le R_i} c_i(j), \quad
        \mathrm{MAP@R} = \frac1{R_i}\sum_{j\le R_i} c_i(j)\,\frac1j\sum_{l\le j} c_i(l),

    averaged over the queries with ``R_i >= 1``. The ``K = max_i R_i`` nearest references
    come from the score ``||r||^2 - 2 q.r`` (the squared distance less the query's own
    ``||q||^2``, which does not change its ranking) by ``torch.matmul`` of all queries
    against ``block`` references at a time, ``torch.topk`` of each block, and a running
    ``topk`` of the kept candidates: memory ``O(n_queries block)``.

    query ``(Q, d)``, query_labels ``(Q,)``, reference ``(N, d)``, reference_labels ``(N,)``
    (integer labels >= 0), one device. Returns floats ``precision_at_1``, ``r_precision``,
    ``mean_average_precision_at_r``, ints ``n_queries`` (queries scored) and
    ``near_ties_at_1``: scored queries whose first two neighbours have different labels and
    squared distances within ``2 d eps (||q||^2 + ||r_1||^2)`` (``eps`` of the dtype): the
    rounding of two float32 rankings can order those two either way, so P@1 may differ
    there and nowhere else.
    """
    n_ref = reference.shape[0]
    counts = torch.bincount(reference_labels, minlength=int(query_labels.max()) + 1)
    r = counts[query_labels]                                            # (Q,)
    scored = r > 0
    query, query_labels, r = query[scored], query_labels[scored], r[scored]
    k = min(int(r.max()), n_ref)
    best_score = best_index = None
    for start in range(0, n_ref, block):
        part = reference[start:start + block]
        score = (part * part).sum(dim=1)[None, :] - 2.0 * torch.matmul(query, part.T)
        values, index = torch.topk(score, min(k, part.shape[0]), dim=1, largest=False)
        index = index + start
        if best_score is not None:
            values = torch.cat([best_score, values], dim=1)
            index = torch.cat([best_index, index], dim=1)
            values, order = torch.topk(values, min(k, values.shape[1]), dim=1, largest=False)
            index = torch.gather(index, 1, order)
        best_score, best_index = values, index
    # topk's order among the kept k: sort them by score (ascending)
    best_score, order = torch.sort(best_score, dim=1)
    best_index = torch.gather(best_index, 1, order)
    hits = reference_labels[best_index] == query_labels[:, None]          # (Q, k)
    ranks = torch.arange(1, k + 1, device=query.device)
    within = ranks[None, :] <= r[:, None]
    # The averages in float64 whatever the dtype: P@1 is then a count over n exactly.
    hits_r = (hits & within).to(torch.float64)
    precision_at_j = torch.cumsum(hits_r, dim=1) / ranks.to(torch.float64)
    r_float = r.to(torch.float64)
    near_ties = 0
    if k >= 2:
        q2 = (query * query).sum(dim=1)
        r1 = reference[best_index[:, 0]]
        margin = 2 * query.shape[1] * torch.finfo(query.dtype).eps * (q2 + (r1 * r1).sum(dim=1))
        tied = (best_score[:, 1] - best_score[:, 0] <= margin) & (
            reference_labels[best_index[:, 0]] != reference_labels[best_index[:, 1]])
        near_ties = int(tied.sum())
    return {
        "precision_at_1": float(hits[:, 0].to(torch.float64).mean()),
        "r_precision": float((hits_r.sum(dim=1) / r_float).mean()),
        "mean_average_precision_at_r": float(
            ((precision_at_j * hits_r).sum(dim=1) / r_float).mean()),
        "n_queries": int(query.shape[0]),
        "near_ties_at_1": near_ties,
    }


# =========================================================================== training
def contrastive_loss(embeddings: torch.Tensor, labels: torch.Tensor, *, pos_margin: float,
                     neg_margin: float) -> torch.Tensor:
    r"""The contrastive loss (Euclidean form) averaged over the ``n (n - 1) / 2`` unordered
    pairs, as refdml.losses.contrastive: ``[d_ij - m+]_+`` for a positive pair,
    ``[m- - d_ij]_+`` for a negative one, ``d_ij = ||x_i - x_j||`` (``F.pdist``, whose
    backward gives 0 at a zero distance). embeddings ``(b, d)``, labels ``(b,)``."""
    distances = F.pdist(embeddings)
    i, j = torch.triu_indices(labels.shape[0], labels.shape[0], offset=1,
                              device=labels.device)
    same = labels[i] == labels[j]
    terms = torch.where(same, torch.relu(distances - pos_margin),
                        torch.relu(neg_margin - distances))
    return terms.mean()


def zero_shot_loss(z: torch.Tensor, labels: torch.Tensor, class_embeddings: torch.Tensor,
                   first: torch.Tensor, second: torch.Tensor, *, ridge: float,
                   scale: float) -> torch.Tensor:
    r"""GSP's cross-batch zero-shot regulariser (Sec. 4.3, (P3), Alg. 4).

    The batch splits into class-disjoint halves (row indices ``first``, ``second``); each
    half ``k`` fits the ridge map from its histograms ``Z_k`` to its classes' embeddings
    ``T_k = Upsilon[labels_k]``, ``V_k = argmin ||Z_k V - T_k||^2 + ridge ||V||^2
    = Z_k^T (Z_k Z_k^T + ridge I)^{-1} T_k`` (the kernel form of Alg. 4's
    ``Upsilon_k (Z_k^T Z_k + ϵ I)^{-1} Z_k^T``), and predicts the other half:
    ``P_1 = Z_1 V_2``, ``P_2 = Z_2 V_1``. Then the softmax cross-entropy of
    ``S = scale P Upsilon^T`` over all classes, averaged over the batch.
    z ``(b, m)``, labels ``(b,)``, class_embeddings ``(c, e)``.
    """
    targets = class_embeddings[labels]

    def fit(rows):
        zk = z[rows]
        gram = zk @ zk.T + ridge * torch.eye(zk.shape[0], dtype=z.dtype, device=z.device)
        return zk.T @ torch.linalg.solve(gram, targets[rows])               # (m, e)

    predictions = torch.empty_like(targets)
    predictions = predictions.index_copy(0, first, z[first] @ fit(second))
    predictions = predictions.index_copy(0, second, z[second] @ fit(first))
    scores = scale * predictions @ class_embeddings.T
    return F.cross_entropy(scores, labels)


def gsp_objective(y: torch.Tensor, z: torch.Tensor, labels: torch.Tensor,
                  class_embeddings: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
                  *, lambda_: float, ridge: float, scale: float, pos_margin: float,
                  neg_margin: float) -> torch.Tensor:
    r"""GSP Alg. 1: ``(1 - lambda) L_contrastive(y) + lambda L_ZSR(z)`` (refdml's
    ``GSPObjective`` with the contrastive base). y ``(b, e)``, z ``(b, m)``."""
    value = y.new_zeros(())
    if lambda_ < 1.0:
        value = value + (1.0 - lambda_) * contrastive_loss(
            y, labels, pos_margin=pos_margin, neg_margin=neg_margin)
    if lambda_ > 0.0:
        value = value + lambda_ * zero_shot_loss(z, labels, class_embeddings, first, second,
                                                 ridge=ridge, scale=scale)
    return value


def collage_twin(model, objective, optimizer, x, labels, *, device="cpu", dtype=None,
                 n_iter: int = N_ITER, rng=0, split=None):
    r"""A refdml digits-collage model, objective and Adam as a PyTorch model trained by
    autograd, every piece in torch on ``device``: scripts/_torch_twin.py's twin (its
    convolutions, per-location linear map, linear layer, L2 normalisation and
    ``torch.optim.Adam``) with the GSP head by :func:`gsp_pool` and the objective by
    :func:`gsp_objective` instead of refdml's own objects.

    ``objective`` must be refdml's ``GSPObjective`` around the contrastive loss (the
    digits-collage default) and the head's ``p`` 1. As refdml's objective does, each step
    draws the class-disjoint split of the batch on the host, from ``rng``
    (``refdml.crossbatch.class_disjoint_split``); ``split`` (a boolean mask) fixes it.
    ``dtype``: the torch dtype of the parameters and images (default: as refdml's).
    Returns the :class:`~_torch_twin.TorchTwin`; ``twin.split`` may be set later.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torch_twin import torch_twin

    from refdml.crossbatch import class_disjoint_split
    from refdml.losses._common import check_contrastive_margins
    from refdml.train.objectives import GSPObjective

    if not isinstance(objective, GSPObjective) or objective.base.loss_name != "contrastive":
        raise TypeError(f"collage_twin needs a GSPObjective around the contrastive loss, got "
                        f"{objective!r}")
    hyper = objective.base.hyperparameters
    if hyper.get("form", "euclidean") != "euclidean":
        raise ValueError("collage_twin: the contrastive loss's Euclidean form only")
    pos_margin, neg_margin = check_contrastive_margins(
        "euclidean", hyper.get("pos_margin"), hyper.get("neg_margin"))
    host_labels = np.asarray(labels)
    generator = np.random.default_rng(rng)
    device_labels = torch.as_tensor(host_labels, device=device)
    class_name = objective.class_embeddings.name

    def head(layer, features, prototypes):
        if layer.p != 1.0:
            raise ValueError(f"collage_twin: GSP head with p == {layer.p}; p = 1 only")
        return gsp_pool(features, prototypes, mu=layer.mu,
                        inverse_temperature=layer.inverse_temperature, n_iter=n_iter)

    def loss(outputs, parameters):
        y, z = outputs
        mask = twin.split if twin.split is not None else class_disjoint_split(
            host_labels, rng=generator)
        first = torch.as_tensor(np.flatnonzero(mask), device=device)
        second = torch.as_tensor(np.flatnonzero(~mask), device=device)
        return gsp_objective(y, z, device_labels, parameters[class_name], first, second,
                             lambda_=objective.lambda_, ridge=objective.ridge,
                             scale=objective.scale, pos_margin=pos_margin,
                             neg_margin=neg_margin)

    twin = torch_twin(model, objective, optimizer, x, labels, device=device, dtype=dtype,
                      gsp_head=head, objective_loss=loss)
    twin.split = split
    return twin
