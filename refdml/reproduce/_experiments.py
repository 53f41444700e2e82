"""The experiments: id, the paper's claim, the runs, and the comparisons that decide it.

An :class:`Experiment` names its runs (``label -> (study, method, settings)``), each run
over the mode's seeds, and the :class:`Comparison` s that test the claim: "run A's
``metric`` is higher (``direction=+1``) / lower (``-1``) than run B's", each a paired
comparison over seeds, judged together with the experiment's other comparisons
(:mod:`refdml.reproduce.stats`: the t interval, both runs' gates, the plateau, power and
Holm's adjustment). An experiment states where it departs from its paper
(``deviations``) and whether its claim is the project's own question rather than the
paper's (``own_question``).

A run may choose one hyperparameter on the validation split (:class:`Selection`): it is
trained at every candidate value over the same seeds, and the value with the best mean
validation metric is the run; its test metric is what the comparisons use, and every
candidate's per-seed values are kept beside it. The test split never picks a value.

Settings live here (not in refdml.train's study defaults) and are recorded in the output.
Runs of different experiments with the same study, method, seed and settings are the same
task, run once (e.g. the collage ``gap`` + contrastive baseline of ``gsp.collage`` and
``xml.crossbatch``). Two modes: ``quick`` (a smoke run: short runs, few seeds, verdicts
``smoke``) and ``full`` (the default run, the project's evidence: every run trains to a
plateau within a budget); docs/reproduce.md gives the reasons for each setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from refdml.reproduce._spec import Task
from refdml.reproduce.stats import RESOLUTION

__all__ = ["Comparison", "Experiment", "EXPERIMENTS", "MODES", "SCALES", "Selection",
           "settings_for"]

MODES = ("quick", "full")
SEEDS = {"quick": 3, "full": 10}

#: The papers' optimiser (GSP supp. and ASAP App. A.2; docs/reproduce.md, "Training
#: protocols"): Adam with moments (0.9, 0.99) and weight decay 1e-4 (coupled, as PyTorch's
#: ``Adam(weight_decay=...)``). The learning rates stay ours: the papers fine-tune an
#: ImageNet-pretrained network at 1e-5, these studies train small networks from scratch.
ADAM = {"betas": [0.9, 0.99], "weight_decay": 1e-4}
#: "Default Adam" (GSP supp. 2.2, digits-collage's model Cifar-Collage): PyTorch's defaults.
DEFAULT_ADAM = {"betas": [0.9, 0.999], "weight_decay": 0.0}

#: Settings per study and mode. Sources: "paper" where it applies, else ours (docs).
SETTINGS = {
    "tokens": {
        "common": {"n_train_per_class": 64, "n_val_per_class": 16, "n_test_per_class": 16,
                   "dim": 16, "embedding_dim": 16, "n_prototypes": 16, "mu": 0.3,
                   "inverse_temperature": 5.0, "loss": "contrastive", "lr": 1e-3},
        # full: the paper's early-stopping patience (GSP supp. 2.1: 30 epochs on MAP@R)
        # within a budget of 100 epochs
        "quick": {"epochs": 8}, "full": {"epochs": 100, "patience": 30}},
    "collage": {
        # the trunk of refdml.train's digits-collage defaults (docs/train.md says why); GSP at
        # the paper's Cifar-Collage settings (supp. 2.2: m = 128, mu = 0.2, inverse temperature
        # 10, zero-shot weight 0.5); XML at its paper's (inverse temperature 10, lambda 0.01);
        # ASAP at its (8, b = 12). Trained as supp. 2.2 says: "default Adam" (0.9, 0.999, no
        # weight decay) at 1e-3, reduce on plateau with factor 0.5 and patience 5.
        "common": {"collages_per_image": 4, "conv_channels": [16, 32, 32],
                   "conv_strides": [1, 2, 1], "local_dim": 64, "embedding_dim": 64,
                   "n_prototypes": 128, "mu": 0.2, "inverse_temperature": 10.0,
                   "gemean_p": 3.0, "zsr_lambda": 0.5, "ridge": 0.05, "xml_lambda": 0.01,
                   "xml_inverse_temperature": 10.0, "proxies_per_class": 8, "budget": 12,
                   "asap_lambda": 2e-4, "transfer_repeats": 20, "lr": 1e-3,
                   **DEFAULT_ADAM, "plateau_factor": 0.5, "plateau_patience": 5},
        # full: stop a run 6 epochs after its best validation MAP@R (the paper gives no
        # patience for Cifar-Collage; 6 gives the schedule's halved rate one epoch) within a
        # budget of 20 epochs; ASAP passes to its next instance on a 3-epoch plateau
        "quick": {"epochs": 4, "patience": 2, "instance_patience": 1},
        "full": {"epochs": 20, "patience": 6, "instance_patience": 3}},
    "wdml": {
        # margins: chosen per method on the validation split (WDML_MARGINS, below)
        "common": {"n_train_per_class": 32, "n_val_per_class": 8, "n_test_per_class": 8,
                   "tokens_per_sample": 12, "dim": 16, "n_classes_per_batch": 8, "eps": 0.05,
                   "sinkhorn_iter": 30, "lr": 1e-3},
        "quick": {"epochs": 10}, "full": {"epochs": 40, "patience": 8}},
    # Single glyphs (refdml.train.data.make_glyphs): every class of the selection, split
    # 0.55 / 0.15 / 0.30 (about 330 / 90 / 180 classes), one instance per font. docs say why
    # single glyphs rather than glyph collages on the CPU (``--scale large`` has them).
    # GSP, XML and ASAP at their papers' CUB settings (GSP Sec. 4.4 and supp. 1.6.7: m = 64,
    # mu = 0.3, inverse temperature 5 for pair losses and 0.5 for proxy losses
    # (``loss_settings``), zero-shot weight 0.1; XML Sec. 3.1: inverse temperature 10, lambda
    # 0.01; ASAP App. A.2: 8 proxies, b = 12).
    "glyph": {
        "common": {"glyph_size": 16, "max_classes": None, "instances_per_font": 1,
                   "eval_instances_per_font": 1, "conv_channels": [16, 32, 32],
                   "conv_strides": [1, 2, 2], "local_dim": 64, "embedding_dim": 64,
                   "n_prototypes": 64, "mu": 0.3, "inverse_temperature": 5.0,
                   "gemean_p": 3.0, "zsr_lambda": 0.1, "ridge": 0.05, "xml_lambda": 0.01,
                   "xml_inverse_temperature": 10.0, "proxies_per_class": 8, "budget": 12,
                   "asap_lambda": 2e-4, "transfer_repeats": 20, "lr": 3e-3,
                   "n_classes_per_batch": 16, "n_samples_per_class": 4, **ADAM},
        # quick: 200 of the ~600 classes (about 60 test classes), a few epochs. full: stop a
        # run 4 epochs after its best validation MAP@R (GSP supp. 1.6: reduce on plateau
        # with patience 4 on CUB) within a budget of 16 epochs; ASAP passes to its next
        # instance on a 3-epoch plateau (ASAP Sec. 4.4) and stops after 6 (two plateaus)
        "quick": {"epochs": 3, "patience": 2, "instance_patience": 1, "max_classes": 200},
        "full": {"epochs": 16, "patience": 4, "instance_patience": 3}},
    "glyph_wdml": {
        "common": {"glyph_size": 16, "max_classes": None, "instances_per_font": 1,
                   "eval_instances_per_font": 1, "conv_channels": [16, 32, 32],
                   "conv_strides": [1, 2, 2], "local_dim": 32, "eval_per_class": 2,
                   "eps": 0.05, "sinkhorn_iter": 30, "lr": 3e-3, "n_classes_per_batch": 8,
                   "n_samples_per_class": 4},
        "quick": {"epochs": 2, "max_classes": 200}, "full": {"epochs": 10, "patience": 3}},
    # Glyph collages: ``--scale large`` only (docs/reproduce.md, "Glyphs"). Distractors: the
    # glyph families, shared by the splits as Cifar Collage's super-classes are
    # (refdml.train.data.GLYPH_FAMILIES), their members split across the splits.
    "glyph_collage": {
        "common": {"glyph_size": 28, "max_classes": None, "instances_per_font": 2,
                   "eval_instances_per_font": 1, "collages_per_image": 2,
                   "n_background": [0, 0, 0],
                   "families": ["digits", "arrows", "operators", "currency"],
                   "conv_channels": [32, 64, 64, 64],
                   "conv_strides": [2, 2, 2, 1], "local_dim": 128, "embedding_dim": 128,
                   "n_prototypes": 64, "mu": 0.3, "inverse_temperature": 5.0,
                   "gemean_p": 3.0, "zsr_lambda": 0.1, "ridge": 0.05, "xml_lambda": 0.01,
                   "xml_inverse_temperature": 10.0, "proxies_per_class": 8, "budget": 12,
                   "asap_lambda": 2e-4, "transfer_repeats": 20, "lr": 1e-3,
                   "n_classes_per_batch": 16, "n_samples_per_class": 4, **ADAM},
        "quick": {"epochs": 20, "instance_every": 5},
        "full": {"epochs": 60, "instance_every": 10, "patience": 10}},
    "toy": {"common": {}, "quick": {}, "full": {}},
}


#: ``refdml reproduce --scale``: ``small`` (the default: this file's settings, sized for a
#: 2-core CPU) or ``large`` (for a GPU, ``--device cuda``): more instances per class, larger
#: glyphs and models, more epochs, and the glyph-collage experiment, which does not learn
#: within the CPU budget (docs/reproduce.md, "Glyphs"). Other studies are the same at both.
SCALES = ("small", "large")
SCALE_SETTINGS = {
    "large": {
        "glyph": {"common": {"glyph_size": 28, "instances_per_font": 3,
                             "conv_channels": [32, 64, 64], "conv_strides": [1, 2, 2],
                             "local_dim": 128, "embedding_dim": 128},
                  "quick": {"epochs": 10, "max_classes": None},
                  "full": {"epochs": 30}},
        "glyph_collage": {"common": {}, "quick": {}, "full": {}},
        "glyph_wdml": {"common": {"glyph_size": 28, "instances_per_font": 3,
                                  "conv_channels": [32, 64, 64], "conv_strides": [2, 2, 2],
                                  "local_dim": 64, "eval_per_class": 4},
                       "quick": {"epochs": 10, "max_classes": None}, "full": {"epochs": 30}},
    },
}


def settings_for(study: str, mode: str, scale: str = "small", **overrides) -> dict:
    """The settings of ``study`` in ``mode`` at ``scale``, then ``overrides``."""
    if scale not in SCALES:
        raise ValueError(f"scale == {scale!r}, must be one of {SCALES}")
    s = SETTINGS[study]
    larger = SCALE_SETTINGS.get(scale, {}).get(study, {})
    return {**s["common"], **s[mode], **larger.get("common", {}), **larger.get(mode, {}),
            **overrides}


@dataclass(frozen=True)
class Comparison:
    """``run``'s ``metric`` vs ``baseline``'s, claimed higher (+1) or lower (-1);
    ``resolution``: the effect the experiment is sized to decide (for the seeds an
    inconclusive verdict would need, :func:`refdml.reproduce.seeds_needed`).

    ``gate``: the competence gate's metric (``"test_map_at_r"``): the comparison is judged
    only when the baseline's ``gate`` beats the untrained model's (the per-seed value
    ``untrained_<gate>``, paired by seed) by more than the seeds' spread allows by chance;
    otherwise its verdict is "baseline did not learn" (:mod:`refdml.reproduce.stats`).
    None: no gate (the runner's toy experiments, which train nothing)."""

    run: str
    baseline: str
    metric: str
    direction: int = 1
    resolution: float = RESOLUTION
    gate: str | None = None

    @property
    def name(self) -> str:
        sign = ">" if self.direction > 0 else "<"
        return f"{self.metric}: {self.run} {sign} {self.baseline}"


@dataclass(frozen=True)
class Selection:
    """Choose setting ``key`` among ``values`` by the best (highest) mean of ``metric``
    (a validation metric) over the seeds; ties go to the earlier value. ``paper``: the
    paper's own setting of ``key`` where it states one (reported beside the chosen value),
    None where it gives none."""

    key: str
    values: tuple
    metric: str = "val_map_at_r"
    paper: object = None

    def label(self, run: str, value) -> str:
        """The grid label of ``run`` trained at ``value``."""
        return f"{run} [{self.key}={value}]"


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
    select: dict = field(default_factory=dict)  # run label -> Selection
    scales: tuple = SCALES                      # the scales it runs at
    deviations: tuple = ()                      # where it departs from its paper, and why
    own_question: bool = False                  # a claim of the project's, not the paper's

    def run_settings(self, label: str, mode: str, scale: str = "small",
                     device: str = "cpu") -> dict:
        """A run's settings; ``device="cuda"`` adds ``device`` (so the CPU's cache keys
        are the same as before there was a GPU path)."""
        method, overrides = self.runs[label]
        settings = settings_for(self.study, mode, scale, **overrides)
        return settings if device == "cpu" else {**settings, "device": device}

    def tasks(self, mode: str, seeds: int | None = None, *, scale: str = "small",
              device: str = "cpu") -> dict[str, list[Task]]:
        """``grid label -> [Task per seed]`` for ``mode``: a run's label, or for a run with
        a :class:`Selection` one :meth:`Selection.label` per candidate value."""
        n = self.seeds[mode] if seeds is None else seeds
        grid = {}
        for label, (method, _) in self.runs.items():
            settings = self.run_settings(label, mode, scale, device)
            selection = self.select.get(label)
            variants = ({label: settings} if selection is None else
                        {selection.label(label, v): {**settings, selection.key: v}
                         for v in selection.values})
            for name, config in variants.items():
                grid[name] = [Task.make(self.study, method, s, config) for s in range(n)]
        return grid


#: Margin candidates of the wdml losses (the paper gives none), a factor 1.5-3.3 apart.
#: Contrastive and triplet on L2-normalised means (distances in [0, 2]; refdml.losses'
#: defaults 0.3841 and 0.0961 lie inside); the Wasserstein losses on Sinkhorn divergences
#: of squared costs between token sets (cost units of the clipped token table, where SD
#: between classes is O(0.1-1)). Each grid was widened until its best value (quick mode) was
#: not at an end, or at an end past which nothing changes: contrastive and triplet first
#: chose their largest candidates, 1.0 and 0.2 (then triplet 0.4, 0.8). A triplet margin of 2
#: or more is one loss (unit vectors' distances differ by at most 2: every triplet active).
#: Three candidates each (issue 36: a baseline's grid is the size of the method's): the
#: Euclidean losses' lowest candidates, never chosen in the runs of 2026-11-25..28
#: (contrastive 0.25, triplet 0.1 and 0.2), were cut.
WDML_MARGINS = {
    "contrastive": Selection("contrastive_neg_margin", (0.5, 1.0, 1.5)),
    "triplet": Selection("triplet_margin", (0.4, 0.8, 2.0)),
    "wcontrastive": Selection("wcontrastive_margin", (0.1, 0.3, 1.0)),
    "wtriplet": Selection("wtriplet_margin", (0.05, 0.2, 0.5)),
}


#: Seeds of the glyph experiments: fewer than the small studies' (a glyph run costs
#: 10-60 s), enough for their paired differences (docs/reproduce.md, "Glyphs").
GLYPH_SEEDS = {"quick": 3, "full": 4}

#: Margin candidates of the glyph wdml losses, two each: the token study's choices and one
#: other (contrastive and triplet on L2-normalised means; the Wasserstein losses in squared
#: costs between unit local features).
GLYPH_WDML_MARGINS = {
    "contrastive": Selection("contrastive_neg_margin", (0.5, 1.0)),
    "triplet": Selection("triplet_margin", (0.4, 2.0)),
    "wcontrastive": Selection("wcontrastive_margin", (0.1, 0.3)),
    "wtriplet": Selection("wtriplet_margin", (0.05, 0.2)),
}


# ---- the training protocol (docs/reproduce.md, "Training protocols")
#: The losses trained on pairs of samples and on proxies.
PAIR_LOSSES = ("contrastive", "triplet", "multi_similarity")
PROXY_LOSSES = ("proxy_nca", "proxy_anchor")

#: The proxy losses' protocol (GSP supp. 1.6.7 and ASAP App. A.2 for ProxyNCA++ and
#: Proxy-Anchor): the proxies' learning rate 100 times the network's, and one epoch of
#: warm-up that trains only the embedding layer (and the proxies). ASAP itself uses neither
#: ("We perform no warm-up or do not use learning rate multiplier for the proxies", App. A.2)
#: and the pair losses' batches.
PROXY_PROTOCOL = {"proxy_lr_multiplier": 100.0, "warmup_epochs": 1}

#: GSP's inverse temperature for the proxy losses on the GSP paper's benchmarks (supp.
#: 1.6.7: 0.5 with proxy losses, 5 otherwise); the collage studies keep the Cifar-Collage 10.
GSP_PROXY_INVERSE_TEMPERATURE = {"glyph": 0.5, "glyph_collage": 0.5}

#: Batches (classes per batch P, samples per class K) per study and loss family: the papers'
#: 32 classes x 1 sample for the proxy losses and batches of 32 with 4 samples per class for
#: the pair losses. Digits-collage has 8 training classes: its proxy batches are 8 x 4
#: (batches of 32, as the papers', with 4 samples per class; 1 per class would make batches
#: of 8).
BATCHES = {
    "collage": {"pair": (8, 4), "proxy": (8, 4)},
    "glyph": {"pair": (8, 4), "proxy": (32, 1)},
    "glyph_collage": {"pair": (8, 4), "proxy": (32, 1)},
}


def loss_settings(study: str, loss: str, method: str = "gap") -> dict:
    """A run's settings for ``loss`` and ``method`` on ``study``: the loss, its batches and,
    for a proxy loss (but not ASAP nor the one-proxy pair runs, which train as the pair
    losses do),
    :data:`PROXY_PROTOCOL` and, for GSP, its proxy-loss inverse temperature."""
    family = "proxy" if loss in PROXY_LOSSES and method not in ("asap", "proxy") else "pair"
    p, k = BATCHES[study][family]
    out = {"loss": loss, "n_classes_per_batch": p, "n_samples_per_class": k}
    if family == "proxy":
        out.update(PROXY_PROTOCOL)
        if method in ("gsp", "gsp_zsr") and study in GSP_PROXY_INVERSE_TEMPERATURE:
            out["inverse_temperature"] = GSP_PROXY_INVERSE_TEMPERATURE[study]
    return out


# ---- the settings chosen on validation, for every method and baseline alike
def gsp_mu(study: str) -> Selection:
    """GSP's transport ratio mu (the share of the local features' mass it pools): the
    study's (the paper's) value and half of it. Screened downward because the GSP paper's
    screening found "lower the better for lambda and mu" (supp. 1.5, Table 7)."""
    mu = SETTINGS[study]["common"]["mu"]
    return Selection("mu", (mu, float(f"{mu / 2:.3g}")), paper=None if study == "tokens"
                     else mu)


#: XML's regulariser weight lambda: the paper's 0.01 (XML Sec. 3.1) and GSP's 0.1 for the
#: analogous zero-shot weight.
XML_LAMBDA = Selection("xml_lambda", (0.01, 0.1), paper=0.01)


def lr_grid(study: str) -> Selection:
    """The baselines' grid, the same size as the methods': the learning rate, the study's
    and a third of it (a GAP model has no setting of its own; the learning rate is what a
    tuned baseline tunes first)."""
    lr = SETTINGS[study]["common"]["lr"]
    return Selection("lr", (lr, float(f"{lr / 3:.3g}")), paper=None)


def _pooling_runs(study: str, losses=("contrastive", "proxy_nca"),
                  methods=("gap", "gsp", "gsp_zsr")):
    """``method/loss`` runs and their selections: mu for GSP, the learning rate for GAP."""
    runs, select = {}, {}
    for loss in losses:
        for method in methods:
            label = f"{method}/{loss}"
            runs[label] = (method, loss_settings(study, loss, method))
            select[label] = lr_grid(study) if method == "gap" else gsp_mu(study)
    return runs, select


#: ASAP's runs stop after two plateaus of its instance patience (ASAP Sec. 4.4: a 3-epoch
#: plateau passes to the next projection; a run that a fresh projection cannot improve
#: within its own patience has converged).
ASAP_RUN = {"patience": 6}


def _asap_runs(study: str, losses=PROXY_LOSSES, *, one_proxy: bool = False):
    """``gap/<loss>`` and ``asap/<loss>`` runs (and ``proxy/<loss>``, the same loss against
    one proxy per class, with ``one_proxy``), each choosing its learning rate on
    validation from the same grid; ASAP at the paper's 8 proxies per class."""
    runs, select = {}, {}
    methods = ("gap", "proxy", "asap") if one_proxy else ("gap", "asap")
    for loss in losses:
        for method in methods:
            settings = loss_settings(study, loss, method)
            if method == "asap" and "patience" in SETTINGS[study]["full"]:
                settings.update(ASAP_RUN)
            runs[f"{method}/{loss}"] = (method, settings)
            select[f"{method}/{loss}"] = lr_grid(study)
    return runs, select


def _gated(comparison: Comparison) -> Comparison:
    """``comparison`` with the competence gate on its baseline's test MAP@R."""
    return replace(comparison, gate="test_map_at_r")


#: Seeds of the digits-collage experiments and of the token study's Wasserstein losses (an
#: all-pairs Sinkhorn retrieval per epoch): every run now trains at two or three settings,
#: and both timed runs must fit their goals on this machine's slow days too, when a task
#: takes 2.8 times as long as on a fast one (docs/reproduce.md, "Training protocols").
COLLAGE_SEEDS = {"quick": 3, "full": 5}
WDML_SEEDS = {"quick": 3, "full": 5}

_COLLAGE_RUNS, _COLLAGE_SELECT = _pooling_runs("collage")
_GLYPH_RUNS, _GLYPH_SELECT = _pooling_runs("glyph")
_GLYPH_COLLAGE_RUNS, _GLYPH_COLLAGE_SELECT = _pooling_runs("glyph_collage")
_GLYPH_ASAP_RUNS, _GLYPH_ASAP_SELECT = _asap_runs("glyph")
#: ASAP as printed (Table 1): C2-ASAP and MS-ASAP.
ASAP_PAIR_LOSSES = ("contrastive", "multi_similarity")
_GLYPH_ASAP_PAIR_RUNS, _GLYPH_ASAP_PAIR_SELECT = _asap_runs("glyph", ASAP_PAIR_LOSSES,
                                                            one_proxy=True)


def _pooling_comparisons():
    return tuple(_gated(Comparison(f"{m}/{loss}", f"gap/{loss}", "test_map_at_r", +1))
                 for loss in ("contrastive", "proxy_nca") for m in ("gsp", "gsp_zsr"))


def _asap_comparisons():
    return tuple(_gated(c) for loss in PROXY_LOSSES for c in (
        Comparison(f"asap/{loss}", f"gap/{loss}", "covering_radius", -1),
        Comparison(f"asap/{loss}", f"gap/{loss}", "test_map_at_r", +1)))


def _asap_pair_comparisons():
    """Per pair loss: ASAP against the loss on the batch's pairs (GAP) and against the same
    loss with one proxy per class, on test MAP@R; and the covering radius against the
    one-proxy run (a GAP run has no proxies to cover with)."""
    return tuple(_gated(c) for loss in ASAP_PAIR_LOSSES for c in (
        Comparison(f"asap/{loss}", f"gap/{loss}", "test_map_at_r", +1),
        Comparison(f"asap/{loss}", f"proxy/{loss}", "test_map_at_r", +1),
        Comparison(f"asap/{loss}", f"proxy/{loss}", "covering_radius", -1)))


def _wdml_comparisons():
    return (_gated(Comparison("wcontrastive", "contrastive", "test_map_at_r", +1)),
            _gated(Comparison("wtriplet", "triplet", "test_map_at_r", +1)))


# ---- where the experiments depart from their papers (docs/reproduce.md gives the reasons)
#: Every study trains a small network from scratch on a 2-core CPU.
_FROM_SCRATCH = ("a small convolutional network trained from scratch (the papers fine-tune an "
                 "ImageNet-pretrained BN-Inception or ResNet), at learning rates 100-300 times "
                 "the papers'")
_GLYPHS = ("single glyphs (~330 / 90 / 180 classes) for CUB-200 (a CPU-sized benchmark with "
           "unseen test classes)")
_GLYPH_BUDGET = ("a 16-epoch budget with patience 4 (the paper evaluates every 25 steps and "
                 "stops after 15 evaluations without improvement)")
_COLLAGE = ("digits-collage (8 / 4 / 4 classes of MNIST digits) for Cifar-Collage; batches of "
            "8 classes x 4 (the paper's 16 x 4: digits-collage has 8 training classes)")
_COLLAGE_BUDGET = "a 20-epoch budget with patience 6 (supp. 2.2 states no patience)"
_PROXY_PROTOCOL_NOTE = ("ProxyNCA++ with the CUB protocol's proxy learning rate x100 and "
                        "warm-up epoch (supp. 2.2 states none for it)")

_SETTINGS_NOTE = ("Every run's defining setting is chosen on the validation split from two "
                  "candidates (GSP: mu; GAP, the baseline: the learning rate); the paper's "
                  "setting and the chosen one are listed below the table.")

EXPERIMENTS: dict[str, Experiment] = {e.id: e for e in [
    Experiment(
        "gsp.synthetic", "GSP Sec. 5.1, supp. 2.1, Fig. 3a",
        "On the token study GSP separates the classes better than GAP (higher test MAP@R) "
        "and learns to ignore the background tokens (less pooling weight on them than "
        "their share, which is what GAP gives them).",
        "tokens", {"gap": ("gap", {}), "gsp": ("gsp", {})},
        (_gated(Comparison("gsp", "gap", "test_map_at_r", +1)),
         _gated(Comparison("gsp", "gap", "background_mass", -1))),
        metrics=("test_map_at_r", "background_mass"), figures=("bars", "curves"),
        select={"gap": lr_grid("tokens"), "gsp": gsp_mu("tokens")},
        notes="GSP's mu and GAP's learning rate are each chosen on the validation split from "
              "two candidates.",
        deviations=("learning rate 1e-3 and its third (the paper's 1e-4 needs more epochs "
                    "than the budget of 100)",)),
    Experiment(
        "gsp.collage", "GSP supp. 2.2, Fig. 3b, Table 6 (in spirit)",
        "On digits-collage, GSP and GSP + zero-shot loss beat GAP on unseen classes "
        "(test MAP@R), with the contrastive and the ProxyNCA++ loss.",
        "collage", _COLLAGE_RUNS, _pooling_comparisons(),
        metrics=("test_map_at_r", "class_cell_weight"),
        figures=("bars", "curves", "attention"), seeds=dict(COLLAGE_SEEDS),
        select=dict(_COLLAGE_SELECT), notes=_SETTINGS_NOTE,
        deviations=(_COLLAGE, _FROM_SCRATCH, _COLLAGE_BUDGET, _PROXY_PROTOCOL_NOTE)),
    Experiment(
        "gsp.zsr_transfer", "GSP Sec. 5.1, Fig. 5",
        "With the zero-shot loss, the attribute histograms transfer: a ridge map from class "
        "histograms to class embeddings fitted on half of the unseen classes predicts the "
        "other half's embeddings better (higher MAP@R) than without it.",
        "collage", {"gsp": ("gsp", loss_settings("collage", "contrastive", "gsp")),
                    "gsp_zsr": ("gsp_zsr", loss_settings("collage", "contrastive", "gsp_zsr"))},
        (_gated(Comparison("gsp_zsr", "gsp", "zsr_transfer_map", +1)),),
        metrics=("zsr_transfer_map", "test_map_at_r"), figures=("bars",),
        seeds=dict(COLLAGE_SEEDS), select={"gsp": gsp_mu("collage"), "gsp_zsr": gsp_mu("collage")},
        deviations=(_COLLAGE, _FROM_SCRATCH, _COLLAGE_BUDGET,
                    "the paper shows the transfer on CUB (Fig. 5); here on digits-collage")),
    Experiment(
        "xml.crossbatch", "XML Sec. 2 (Eqs. 2.10-2.11)",
        "The contrastive loss with the XML cross-batch regulariser retrieves unseen classes "
        "better (test MAP@R) than the contrastive loss alone.",
        "collage", {"gap": ("gap", loss_settings("collage", "contrastive")),
                    "xml": ("xml", loss_settings("collage", "contrastive"))},
        (_gated(Comparison("xml", "gap", "test_map_at_r", +1)),),
        figures=("bars", "curves"), seeds=dict(COLLAGE_SEEDS),
        select={"gap": lr_grid("collage"), "xml": XML_LAMBDA},
        notes="XML's lambda and GAP's learning rate are each chosen on the validation split "
              "from two candidates.",
        deviations=(_COLLAGE, _FROM_SCRATCH, _COLLAGE_BUDGET,
                    "the XML paper evaluates on CUB, Cars, SOP and In-shop")),
    Experiment(
        "wdml.losses", "WDML Eqs. 1-2",
        "The Wasserstein contrastive and triplet losses on sets of local features retrieve "
        "better (test MAP@R) than the contrastive and triplet losses on the pooled features.",
        "wdml", {m: (m, {}) for m in ("contrastive", "wcontrastive", "triplet", "wtriplet")},
        _wdml_comparisons(),
        figures=("bars", "curves"), select=dict(WDML_MARGINS), seeds=dict(WDML_SEEDS),
        notes="Each loss's margin is chosen on the validation split (mean validation MAP@R "
              "over the seeds) from 3 candidates (the paper gives none); every candidate's "
              "means are listed below the table.",
        deviations=("sets of 12 synthetic tokens for the paper's local features of images",
                    "a 40-epoch budget with patience 8 (the paper gives no protocol for it)")),
    # ---- the glyph benchmark (refdml.train.data.make_glyphs): ~330 training, ~90
    # validation and ~180 test classes, every test class unseen in training
    Experiment(
        "gsp.glyphs", "GSP Sec. 5.2, Tables 1-2 (unseen classes), on glyphs",
        "On the glyph benchmark (about 180 unseen test classes), GSP and GSP + zero-shot "
        "loss beat GAP (test MAP@R), with the contrastive and the ProxyNCA++ loss.",
        "glyph", _GLYPH_RUNS, _pooling_comparisons(),
        metrics=("test_map_at_r", "test_recall_at_1"), figures=("bars", "curves", "glyphs"),
        seeds=dict(GLYPH_SEEDS), select=dict(_GLYPH_SELECT),
        notes="Single glyphs: every local feature is part of the glyph or of the blank around "
              "it. " + _SETTINGS_NOTE,
        deviations=(_GLYPHS, _FROM_SCRATCH, _GLYPH_BUDGET)),
    Experiment(
        "gsp.glyph_zsr_transfer", "GSP Sec. 5.1, Fig. 5, on glyphs",
        "With the zero-shot loss, a ridge map from class histograms to class embeddings "
        "fitted on half of the ~270 unseen glyph classes predicts the other half's embeddings "
        "better (higher MAP@R) than without it.",
        "glyph", {"gsp": ("gsp", loss_settings("glyph", "contrastive", "gsp")),
                  "gsp_zsr": ("gsp_zsr", loss_settings("glyph", "contrastive", "gsp_zsr"))},
        (_gated(Comparison("gsp_zsr", "gsp", "zsr_transfer_map", +1)),),
        metrics=("zsr_transfer_map", "test_map_at_r"), figures=("bars",),
        seeds=dict(GLYPH_SEEDS), select={"gsp": gsp_mu("glyph"), "gsp_zsr": gsp_mu("glyph")},
        deviations=(_GLYPHS, _FROM_SCRATCH, _GLYPH_BUDGET)),
    Experiment(
        "xml.glyphs", "XML Sec. 2 (Eqs. 2.10-2.11), on glyphs",
        "The contrastive loss with the XML cross-batch regulariser retrieves unseen glyph "
        "classes better (test MAP@R) than the contrastive loss alone.",
        "glyph", {"gap": ("gap", loss_settings("glyph", "contrastive")),
                  "xml": ("xml", loss_settings("glyph", "contrastive"))},
        (_gated(Comparison("xml", "gap", "test_map_at_r", +1)),),
        metrics=("test_map_at_r", "test_recall_at_1"), figures=("bars", "curves"),
        seeds=dict(GLYPH_SEEDS), select={"gap": lr_grid("glyph"), "xml": XML_LAMBDA},
        deviations=(_GLYPHS, _FROM_SCRATCH, _GLYPH_BUDGET)),
    Experiment(
        "asap.glyph_pairs", "ASAP Sec. 5, Table 1 (C2-ASAP, MS-ASAP), on glyphs",
        "On the glyph benchmark, ASAP with a pair loss between samples and alternating proxy "
        "sets (C2-ASAP, MS-ASAP) retrieves unseen classes better (test MAP@R) than the same "
        "loss on the batch's pairs and than the same loss against one proxy per class, and "
        "covers each class with a smaller radius than one proxy per class.",
        "glyph", _GLYPH_ASAP_PAIR_RUNS, _asap_pair_comparisons(),
        metrics=("test_map_at_r", "covering_radius", "test_recall_at_1"),
        figures=("bars", "curves"), seeds=dict(GLYPH_SEEDS),
        select=dict(_GLYPH_ASAP_PAIR_SELECT),
        notes="`gap/<loss>`: the pair loss on the batch's pairs; `proxy/<loss>`: the same pair "
              "loss between samples and one proxy per class (no alternation, no "
              "regulariser); `asap/<loss>`: ASAP (8 proxies per class, pools of 12, lambda "
              "2e-4; the next projection on a 3-epoch validation plateau). Every run chooses "
              "its learning rate on the validation split from the same two candidates.",
        deviations=(_GLYPHS, _FROM_SCRATCH, _GLYPH_BUDGET,
                    "the paper trains 4 models on 4 folds and reports their average and "
                    "ensemble; here one model per seed")),
    Experiment(
        "asap.glyph_proxies", "ASAP Sec. 4.3 (Alg. 1-2) with proxy losses, on glyphs",
        "On the glyph benchmark, ASAP's alternating proxy sets reduce the covering radius and "
        "improve test MAP@R over one proxy per class when the loss is ProxyNCA++ or "
        "Proxy-Anchor.",
        "glyph", _GLYPH_ASAP_RUNS, _asap_comparisons(),
        metrics=("test_map_at_r", "covering_radius"), figures=("bars", "curves"),
        seeds=dict(GLYPH_SEEDS), select=dict(_GLYPH_ASAP_SELECT), own_question=True,
        notes="The project's own question, not the paper's: ASAP's Table 1 pairs it with pair "
              "losses (`asap.glyph_pairs`), and ProxyNCA++ and Proxy-Anchor appear there only "
              "as compared methods. `gap/<loss>` is one proxy per class (a GAP model with the "
              "plain proxy loss). Every run chooses its learning rate on the validation split "
              "from the same two candidates.",
        deviations=(_GLYPHS, _FROM_SCRATCH, _GLYPH_BUDGET,
                    "ASAP with proxy losses, a pairing the paper does not run")),
    Experiment(
        "wdml.glyph_losses", "WDML Eqs. 1-2, on glyphs",
        "The Wasserstein contrastive and triplet losses on the sets of local features of a "
        "glyph retrieve unseen classes better (test MAP@R) than the contrastive and triplet "
        "losses on the pooled features.",
        "glyph_wdml", {m: (m, {}) for m in ("contrastive", "wcontrastive", "triplet",
                                            "wtriplet")},
        _wdml_comparisons(),
        figures=("bars", "curves"), select=dict(GLYPH_WDML_MARGINS), seeds=dict(GLYPH_SEEDS),
        notes="Retrieval on 2 samples per class (the Sinkhorn retrieval costs a divergence "
              "per pair), the same samples for every method: MAP@R is then recall@1, "
              "quantised to 1/(test samples). Each margin is chosen on the validation split "
              "from 2 candidates.",
        deviations=(_GLYPHS, _FROM_SCRATCH, "retrieval among 2 samples per class",
                    "a 10-epoch budget with patience 3 (the paper gives no protocol for it)")),
    Experiment(
        "gsp.glyph_collage", "GSP supp. 2.2, Fig. 3b, Table 6, on glyph collages",
        "On 2 x 2 glyph collages (the label glyph in one cell, distractor glyphs of the "
        "shared families, digits, arrows, operators and currency symbols, in the others), "
        "GSP and GSP + zero-shot loss beat GAP on unseen classes.",
        "glyph_collage", _GLYPH_COLLAGE_RUNS, _pooling_comparisons(),
        metrics=("test_map_at_r", "test_recall_at_1", "class_cell_weight",
                 "class_cell_ratio"),
        figures=("bars", "curves", "attention", "cell_weights", "glyphs"),
        seeds=dict(GLYPH_SEEDS), scales=("large",), select=dict(_GLYPH_COLLAGE_SELECT),
        notes="Large scale only (a GPU): on a 2-core CPU no head learns the collages within "
              "the budget (docs/reproduce.md, Glyphs). " + _SETTINGS_NOTE),
]}
