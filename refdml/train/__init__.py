"""Manual-backprop training for metric learning.

Every layer is a forward/backward pair catalogued like the operators; parameters are
plain objects with a value and an accumulated gradient; a model walks its layers in
reverse by hand. No tape, no autodiff. The same code runs on NumPy (CPU) and CuPy (GPU)
arrays.

Parameters, layers and pooling heads (:mod:`refdml.train.layers`), optimisers
(:mod:`refdml.train.optim`), learning-rate schedules (:mod:`refdml.train.schedules`),
data sets, splits and the P x K sampler (:mod:`refdml.train.data`), objectives
(:mod:`refdml.train.objectives`), the training loop with checkpoints and resume
(:mod:`refdml.train.trainer`), complete runs of the five studies from a plain config
(:func:`refdml.train.runs.build_run`; ``refdml train`` and ``scripts/train_*.py`` wrap it)
and the figures of a run (:mod:`refdml.train.plots`).
"""

from refdml._backend import side_thread
from refdml.train import layers
from refdml.train._parameter import Parameter
from refdml.train.layers import (
    GAP,
    GMP,
    Conv2d,
    Embedding,
    GeMean,
    GSPHead,
    L2Normalize,
    Layer,
    Linear,
    LocalLinear,
    ReLU,
    Sequential,
    XMLHistogramHead,
)
from refdml.train.optim import SGD, Adam, AdamW, NonFiniteStepError, Optimizer, ParamGroup
from refdml.train.schedules import CosineAnnealing, ReduceOnPlateau, Schedule, StepDecay
from refdml.train.trainer import (
    DiskSink,
    MemorySink,
    Trainer,
    TrainingDiverged,
    TrainingLoop,
    TrainingSink,
)
from refdml.train.runs import build_run

__all__ = [
    "GAP",
    "GMP",
    "SGD",
    "Adam",
    "AdamW",
    "Conv2d",
    "CosineAnnealing",
    "DiskSink",
    "Embedding",
    "GSPHead",
    "GeMean",
    "L2Normalize",
    "Layer",
    "Linear",
    "LocalLinear",
    "MemorySink",
    "NonFiniteStepError",
    "Optimizer",
    "ParamGroup",
    "Parameter",
    "ReLU",
    "ReduceOnPlateau",
    "Schedule",
    "Sequential",
    "StepDecay",
    "Trainer",
    "TrainingDiverged",
    "TrainingLoop",
    "TrainingSink",
    "XMLHistogramHead",
    "build_run",
    "layers",
    "side_thread",
]
