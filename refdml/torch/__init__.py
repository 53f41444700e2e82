"""refdml's layers and losses inside PyTorch models (the extra ``torch``).

Every operator of :data:`refdml._interop.BRIDGED` is a PyTorch custom op: its forward is
refdml's fast path (:mod:`refdml.gpu`, on the tensor's device: NumPy on the CPU, CuPy on a
GPU), its backward refdml's hand-derived backward, registered with
``torch.library.register_autograd``; there is no autodiff through refdml's maths.
``torch.compile(model, fullgraph=True)`` traces through them (``register_fake``).

>>> import torch, refdml.torch
>>> x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
>>> y = refdml.torch.op("normalize.l2_normalize")(x=x)
>>> y.sum().backward()

* :func:`op` takes a catalogue name and the catalogue's keywords (tensors for the arrays,
  Python values for the hyperparameters): what ``refdml conform`` and other tools iterate
  over (:func:`names`).
* ``torch.nn.Module`` classes hold parameters the way PyTorch users expect: the GSP
  layer's prototypes and a proxy loss's proxies are ``nn.Parameter``.

Zero copy: float32 and float64 tensors are handed to refdml over their own memory and
refdml's results come back the same way; float16 and bfloat16 are computed in float32
(:mod:`refdml.torch._convert`). docs/torch.md is the user's guide.
"""

from refdml.exceptions import MissingExtraError

try:
    import torch as _torch  # noqa: F401 - the extra's one check, before the modules need it
except ImportError as error:
    raise MissingExtraError("torch", "torch") from error

from refdml.torch._modules import (  # noqa: E402
    ClipNormalize,
    ContrastiveLoss,
    GSPPool,
    GeneralizedContrastiveLoss,
    L2Normalize,
    MultiSimilarityLoss,
    PairwiseSinkhornDivergence,
    ProxyAnchorLoss,
    ProxyContrastiveLoss,
    ProxyMultiSimilarityLoss,
    ProxyNCALoss,
    SinkhornDivergence,
    SoftTripleLoss,
    TripletLoss,
    WContrastiveLoss,
    WTripletLoss,
    XMLLoss,
    ZeroShotLoss,
)
from refdml.torch._ops import TorchOp, names, op  # noqa: E402

__all__ = [
    "ClipNormalize",
    "ContrastiveLoss",
    "GSPPool",
    "GeneralizedContrastiveLoss",
    "L2Normalize",
    "MultiSimilarityLoss",
    "PairwiseSinkhornDivergence",
    "ProxyAnchorLoss",
    "ProxyContrastiveLoss",
    "ProxyMultiSimilarityLoss",
    "ProxyNCALoss",
    "SinkhornDivergence",
    "SoftTripleLoss",
    "TorchOp",
    "TripletLoss",
    "WContrastiveLoss",
    "WTripletLoss",
    "XMLLoss",
    "ZeroShotLoss",
    "names",
    "op",
]
