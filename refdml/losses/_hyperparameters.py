"""Published hyperparameters of the losses (GSP supp. 1.6.7, ASAP App. A.2)."""

from __future__ import annotations

__all__ = ["PAPER_HYPERPARAMETERS"]

# Default margins of `contrastive` per form: C2 with the CUB-200 values of GSP supp. 1.6.7
# (m+, m-) = (0, 0.3841); XBM's C1 on cosine similarity, 1 - s for positives, margin 0.5.
CONTRASTIVE_DEFAULTS = {"euclidean": (0.0, 0.3841), "cosine": (1.0, 0.5)}


def _per_dataset(cub200, cars196, inshop, sop) -> dict:
    return {"cub200": cub200, "cars196": cars196, "inshop": inshop, "sop": sop}


#: Per-dataset hyperparameters of GSP supp. 1.6.7 and ASAP App. A.2, as keyword arguments:
#: ``contrastive(x, y, **PAPER_HYPERPARAMETERS["contrastive"]["sop"])``. Where the two
#: papers differ (ProxyNCA++ temperature: GSP 0.11, ASAP 0.1) GSP's value is used;
#: SoftTriple is given in ASAP only.
PAPER_HYPERPARAMETERS = {
    "contrastive": _per_dataset(
        {"pos_margin": 0.0, "neg_margin": 0.3841},
        {"pos_margin": 0.2652, "neg_margin": 0.5409},
        {"pos_margin": 0.2858, "neg_margin": 0.5130},
        {"pos_margin": 0.2858, "neg_margin": 0.5130},
    ),
    "contrastive_cosine": _per_dataset(*[{"form": "cosine", "pos_margin": 1.0, "neg_margin": 0.5}] * 4),
    "triplet": _per_dataset({"margin": 0.0961}, {"margin": 0.1190}, {"margin": 0.0451}, {"margin": 0.0451}),
    "multi_similarity": _per_dataset(
        {"alpha": 2.0, "beta": 40.0, "base": 0.5},
        {"alpha": 14.35, "beta": 75.83, "base": 0.66},
        {"alpha": 8.49, "beta": 57.38, "base": 0.41},
        {"alpha": 2.0, "beta": 40.0, "base": 0.5},
    ),
    "proxy_anchor": _per_dataset(*[{"delta": 0.1, "alpha": 32.0}] * 4),
    "proxy_nca": _per_dataset(*[{"temperature": 0.11}] * 4),
    "soft_triple": _per_dataset(
        {"lambda_": 20.0, "gamma": 0.1, "tau": 0.2, "delta": 0.01},
        {"lambda_": 17.69, "gamma": 19.18, "tau": 0.0669, "delta": 0.3588},
        {"lambda_": 20.0, "gamma": 0.1, "tau": 0.2, "delta": 0.01},
        {"lambda_": 100.0, "gamma": 47.9, "tau": 0.2, "delta": 0.3145},
    ),
}
