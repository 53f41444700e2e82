"""The experiments: id, the paper's claim, the runs, and the comparisons that decide it.

An :class:`Experiment` names its runs (``label -> (study, method, settings)``), each run
over the mode's seeds, and the :class:`Comparison` s that test the claim: "run A's
``metric`` is higher (``direction=+1``) / lower (``-1``) than run B's", each a paired
bootstrap over seeds (:mod:`refdml.reproduce._stats`). The experiment's verdict:
``reproduced`` when every comparison is, ``not-reproduced`` when any is, else
``inconclusive``.

Settings live here (not in refdml.train's study defaults) and are recorded in the output.
Runs of different experiments with the same study, method, seed and settings are the same
task, run once (e.g. the collage ``gap`` + contrastive baseline of ``gsp.collage`` and
``xml.crossbatch``). Two modes: ``quick`` (5 seeds, short runs) and ``full`` (10 seeds,
longer runs); docs/reproduce.md gives the reasons for each setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refdml.reproduce._tasks import Task

__all__ = ["Comparison", "Experiment", "EXPERIMENTS", "MODES", "settings_for"]

MODES = ("quick", "full")
SEEDS = {"quick": 5, "full": 10}

#: Settings per study and mode. Sources: "paper" where it applies, else ours (docs).
SETTINGS = {
    "tokens": {
        "common": {"n_train_per_class": 64, "n_test_per_class": 16, "dim": 16,
                   "embedding_dim": 16, "n_prototypes": 16, "mu": 0.3,
                   "inverse_temperature": 5.0, "loss": "contrastive", "lr": 1e-3},
        "quick": {"epochs": 8}, "full": {"epochs": 20}},
    "collage": {
        # the trunk of refdml.train's digits-collage defaults (docs/train.md says why)
        "common": {"collages_per_image": 4, "conv_channels": [16, 32, 32],
                   "conv_strides": [1, 2, 1], "local_dim": 64, "embedding_dim": 64,
                   "n_prototypes": 128, "mu": 0.2, "inverse_temperature": 10.0,
                   "gemean_p": 3.0, "zsr_lambda": 0.5, "ridge": 0.05, "xml_lambda": 0.5,
                   "xml_inverse_temperature": 5.0, "proxies_per_class": 8, "budget": 12,
                   "asap_lambda": 2e-4, "transfer_repeats": 20, "lr": 1e-3},
        "quick": {"epochs": 4, "instance_every": 2},
        "full": {"epochs": 15, "instance_every": 5}},
    "wdml": {
        "common": {"n_train_per_class": 32, "n_test_per_class": 8, "tokens_per_sample": 12,
                   "dim": 16, "n_classes_per_batch": 8, "eps": 0.05, "sinkhorn_iter": 30,
                   "wcontrastive_margin": 1.0, "wtriplet_margin": 0.2, "lr": 1e-3},
        "quick": {"epochs": 10}, "full": {"epochs": 25}},
    "toy": {"common": {}, "quick": {}, "full": {}},
}


def settings_for(study: str, mode: str, **overrides) -> dict:
    s = SETTINGS[study]
    return {**s["common"], **s[mode], **overrides}


@dataclass(frozen=True)
class Comparison:
    """``run``'s ``metric`` vs ``baseline``'s, claimed higher (+1) or lower (-1)."""

    run: str
    baseline: str
    metric: str
    direction: int = 1

    @property
    def name(self) -> str:
        sign = ">" if self.direction > 0 else "<"
        return f"{self.metric}: {self.run} {sign} {self.baseline}"


@dataclass(frozen=True)
class Experiment:
    id: str
    paper: str
    claim: str
    study: str
    runs: dict            # label -> (method, settings overrides)
    comparisons: tuple
    metrics: tuple = ("test_map_at_r",)     # reported per run
    figures: tuple = ()                     # kinds: "bars", "curves", "attention", "embedding_2d"
    notes: str = ""
    seeds: dict = field(default_factory=lambda: dict(SEEDS))

    def run_settings(self, label: str, mode: str) -> dict:
        method, overrides = self.runs[label]
        return settings_for(self.study, mode, **overrides)

    def tasks(self, mode: str, seeds: int | None = None) -> dict[str, list[Task]]:
        """``label -> [Task per seed]`` for ``mode``."""
        n = self.seeds[mode] if seeds is None else seeds
        return {label: [Task.make(self.study, method, s, self.run_settings(label, mode))
                        for s in range(n)]
                for label, (method, _) in self.runs.items()}


def _collage_runs():
    runs = {}
    for loss in ("contrastive", "proxy_nca"):
        for method in ("gap", "gmp", "gemean", "gsp", "gsp_zsr"):
            runs[f"{method}/{loss}"] = (method, {"loss": loss})
    return runs


EXPERIMENTS: dict[str, Experiment] = {e.id: e for e in [
    Experiment(
        "gsp.synthetic", "GSP Sec. 5.1, supp. 2.1, Fig. 3a",
        "On the token study GSP separates the classes better than GAP (higher test MAP@R) "
        "and learns to ignore the background tokens (less pooling weight on them than "
        "their share, which is what GAP gives them).",
        "tokens", {"gap": ("gap", {}), "gsp": ("gsp", {})},
        (Comparison("gsp", "gap", "test_map_at_r", +1),
         Comparison("gsp", "gap", "background_mass", -1)),
        metrics=("test_map_at_r", "background_mass"), figures=("bars", "curves")),
    Experiment(
        "gsp.collage", "GSP supp. 2.2, Fig. 3b, Table 6 (in spirit)",
        "On digits-collage, GSP and GSP + zero-shot loss beat GAP on unseen classes "
        "(test MAP@R), with the contrastive and the ProxyNCA++ loss.",
        "collage", _collage_runs(),
        tuple(Comparison(f"{m}/{loss}", f"gap/{loss}", "test_map_at_r", +1)
              for loss in ("contrastive", "proxy_nca") for m in ("gsp", "gsp_zsr")),
        metrics=("test_map_at_r", "class_cell_weight"),
        figures=("bars", "curves", "attention")),
    Experiment(
        "gsp.zsr_transfer", "GSP Sec. 5.1, Fig. 5",
        "With the zero-shot loss, the attribute histograms transfer: a ridge map from class "
        "histograms to class embeddings fitted on half of the unseen classes predicts the "
        "other half's embeddings better (higher MAP@R) than without it.",
        "collage", {"gsp": ("gsp", {"loss": "contrastive"}),
                    "gsp_zsr": ("gsp_zsr", {"loss": "contrastive"})},
        (Comparison("gsp_zsr", "gsp", "zsr_transfer_map", +1),),
        metrics=("zsr_transfer_map", "test_map_at_r"), figures=("bars",)),
    Experiment(
        "xml.crossbatch", "XML Sec. 2 (Eqs. 2.10-2.11)",
        "The contrastive loss with the XML cross-batch regulariser retrieves unseen classes "
        "better (test MAP@R) than the contrastive loss alone.",
        "collage", {"gap": ("gap", {"loss": "contrastive"}),
                    "xml": ("xml", {"loss": "contrastive"})},
        (Comparison("xml", "gap", "test_map_at_r", +1),),
        figures=("bars", "curves")),
    Experiment(
        "asap.proxies", "ASAP Sec. 5, Fig. 1 and 4a",
        "ASAP's alternating proxy sets (several proxies per class, greedy k-center "
        "re-initialisation from per-class pools of b samples) reduce the proxies' covering "
        "radius and improve test MAP@R over one proxy per class, for ProxyNCA++ and "
        "Proxy-Anchor.",
        "collage", {f"{m}/{loss}": (m, {"loss": loss}) for loss in ("proxy_nca", "proxy_anchor")
                    for m in ("gap", "asap")},
        tuple(c for loss in ("proxy_nca", "proxy_anchor") for c in (
            Comparison(f"asap/{loss}", f"gap/{loss}", "covering_radius", -1),
            Comparison(f"asap/{loss}", f"gap/{loss}", "test_map_at_r", +1))),
        metrics=("test_map_at_r", "covering_radius"),
        figures=("bars", "curves", "embedding_2d"),
        notes="`gap/<loss>` is one proxy per class (a GAP model with the plain proxy loss)."),
    Experiment(
        "wdml.losses", "WDML Eqs. 1-2",
        "The Wasserstein contrastive and triplet losses on sets of local features retrieve "
        "better (test MAP@R) than the contrastive and triplet losses on the pooled features.",
        "wdml", {m: (m, {}) for m in ("contrastive", "wcontrastive", "triplet", "wtriplet")},
        (Comparison("wcontrastive", "contrastive", "test_map_at_r", +1),
         Comparison("wtriplet", "triplet", "test_map_at_r", +1)),
        figures=("bars", "curves")),
]}
