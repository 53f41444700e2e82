"""Manual-backprop training for metric learning (issue 12; under construction).

Every layer is a forward/backward pair catalogued like the operators; parameters are
plain objects with a value and an accumulated gradient; a model walks its layers in
reverse by hand. No tape, no autodiff. The same code runs on NumPy (CPU) and CuPy (GPU)
arrays.
"""

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

__all__ = [
    "GAP",
    "GMP",
    "Conv2d",
    "Embedding",
    "GSPHead",
    "GeMean",
    "L2Normalize",
    "Layer",
    "Linear",
    "LocalLinear",
    "Parameter",
    "ReLU",
    "Sequential",
    "XMLHistogramHead",
    "layers",
]
