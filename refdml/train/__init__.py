"""Manual-backprop training for metric learning (issue 12; under construction).

Every layer is a forward/backward pair catalogued like the operators; parameters are
plain objects with a value and an accumulated gradient; a model walks its layers in
reverse by hand. No tape, no autodiff. The same code runs on NumPy (CPU) and CuPy (GPU)
arrays.
"""

from refdml.train._parameter import Parameter
from refdml.train.optim import SGD, Adam, AdamW, Optimizer
from refdml.train.schedules import CosineAnnealing, ReduceOnPlateau, Schedule, StepDecay

__all__ = [
    "Parameter",
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "Schedule",
    "StepDecay",
    "CosineAnnealing",
    "ReduceOnPlateau",
]
