"""Catalogue entries of :mod:`refdml.normalize`."""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.gpu import normalize as fast
from refdml.normalize import (
    clip_normalize_backward,
    clip_normalize_forward,
    l2_normalize_backward,
    l2_normalize_forward,
)


def _mixed_norm_vectors(rng: np.random.Generator) -> dict:
    # Rows both inside and outside the unit ball, none near the sphere (the kink).
    x = rng.standard_normal((6, 4))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x *= np.array([0.3, 0.7, 0.9, 1.2, 2.0, 3.5])[:, None]
    return {"x": x}


OPERATORS = (
    OperatorSpec(
        name="normalize.clip_normalize",
        forward=clip_normalize_forward,
        backward=clip_normalize_backward,
        mirror=fast.clip_normalize_forward,
        mirror_backward=fast.clip_normalize_backward,
        make_inputs=_mixed_norm_vectors,
        paper="GSP Alg. 2 normalisation; ASAP Sec. 4.4",
    ),
    OperatorSpec(
        name="normalize.l2_normalize",
        forward=l2_normalize_forward,
        backward=l2_normalize_backward,
        mirror=fast.l2_normalize_forward,
        mirror_backward=fast.l2_normalize_backward,
        make_inputs=_mixed_norm_vectors,
        paper="L2 normalisation of embeddings",
    ),
)
