"""refdml: reference operators of four deep-metric-learning papers, with hand-derived gradients.

Submodules are imported on first attribute access, so ``import refdml`` is cheap and
``refdml.gsp.weight_transport(...)`` works without a separate import.

=================  ==========================================================
``gradcheck``      finite-difference checks of hand-written backward passes
``normalize``      clipped and L2 normalisation (GSP Alg. 2, ASAP Sec. 4.4)
``distances``      pairwise Euclidean / squared Euclidean / cosine similarity
``gsp``            Generalized Sum Pooling: cost map, (P1), (P2), pooling layer
``histogram``      XML histogram operator, Eqs. (2.1)-(2.4)
``losses``         DML losses with hand-derived gradients
``metrics``        retrieval and clustering metrics
``prototypes``     ridge / RLS prototype fits (XML Sec. 2.2)
``crossbatch``     XML loss (Eq. 2.10) and zero-shot loss (GSP Eq. 4.4, Alg. 4)
``ot``             Sinkhorn, Sinkhorn divergences, Wasserstein DML losses
``coresets``       Wasserstein coresets and WCRAIG facility location
``kcenter``        greedy k-center (Gonzalez) and ASAP proxy selection
``validation``     numerical checks of every claim of the papers
``gpu``            CuPy / Numba CUDA mirrors of the reference operators
=================  ==========================================================
"""

from __future__ import annotations

import importlib

from refdml.exceptions import ConvergenceWarning, RefdmlWarning

# The version's one source: pyproject.toml reads it ([tool.setuptools.dynamic]), so the
# installed metadata and `refdml --version` agree by construction.
__version__ = "0.1.0"

_SUBMODULES = (
    "gradcheck",
    "normalize",
    "distances",
    "gsp",
    "histogram",
    "losses",
    "metrics",
    "prototypes",
    "crossbatch",
    "ot",
    "coresets",
    "kcenter",
    "validation",
    "gpu",
)

__all__ = ["ConvergenceWarning", "RefdmlWarning", "__version__", *_SUBMODULES]


def __getattr__(name: str):
    # Lazy access to refdml's own subpackages, by a name from the fixed tuple above: the one
    # place where refdml loads a module named by a string (tests/test_architecture.py allows
    # it here only). A static import would load every layer, POT and Numba included, on
    # `import refdml`.
    if name in _SUBMODULES:
        return importlib.import_module(f"refdml.{name}")
    raise AttributeError(f"module 'refdml' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
