"""Catalogue entries of :mod:`refdml.distances`."""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.distances import (
    cosine_backward,
    cosine_forward,
    euclidean_backward,
    euclidean_forward,
    sq_euclidean_backward,
    sq_euclidean_forward,
)
from refdml.gpu import distances as fast


def _two_sets(rng: np.random.Generator) -> dict:
    # A broadcast leading dimension, so the backward's sum over it is checked too.
    return {"x": rng.standard_normal((2, 4, 3)), "y": rng.standard_normal((1, 5, 3))}


OPERATORS = tuple(
    OperatorSpec(
        name=name, forward=forward, backward=backward, make_inputs=_two_sets, paper=paper,
        mirror=mirror, mirror_backward=mirror_backward,
    )
    for name, forward, backward, mirror, mirror_backward, paper in (
        ("distances.euclidean", euclidean_forward, euclidean_backward,
         fast.euclidean_forward, fast.euclidean_backward,
         "GSP Alg. 2 cost map; d_f of ASAP Sec. 3"),
        ("distances.sq_euclidean", sq_euclidean_forward, sq_euclidean_backward,
         fast.sq_euclidean_forward, fast.sq_euclidean_backward,
         "squared Euclidean distance"),
        ("distances.cosine", cosine_forward, cosine_backward,
         fast.cosine_forward, fast.cosine_backward,
         "cosine similarity (XBM C1, proxy losses)"),
    )
)
