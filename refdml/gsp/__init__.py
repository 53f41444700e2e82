r"""Generalized Sum Pooling (GSP): cost map, the transport problems (P1)/(P2), the pooling layer.

Shapes: ``B`` images, ``n`` features per image, ``m`` prototypes, ``d`` channels.
features ``(B, n, d)``, prototypes ``(m, d)``, cost ``(B, m, n)``, rho ``(B, n)``,
pi ``(B, m, n)``. ``inverse_temperature`` is the paper's ε (varepsilon), which
multiplies the cost (``exp(-ε c)``: larger = sharper, 0 = uniform); GSP's defaults are
0.5 with proxy losses and 5.0 with pair losses.

Operators (one private module each, re-exported here)
-----------------------------------------------------
``cost_map_forward`` / ``cost_map_backward`` (GSP Alg. 2; ``_cost.py``)
    ``c_ij = || wbar_i - fbar_j ||`` with ``ubar = u / max(1, ||u||)``.
``solve_p1_linprog`` / ``solve_p1_pot`` (GSP (P1); ``_p1.py``; validation only)
    The LP, exactly, with HiGHS and as a partial optimal-transport problem in POT.
``weight_transport`` / ``weight_transport_backward`` / ``weight_transport_backward_unrolled``
    (GSP (P2), Prop. 4.2, Prop. 4.3; ``_transport.py``) The entropic problem

    .. math::
        \min_{\rho, \pi \ge 0} \sum_{ij} c_{ij}\pi_{ij}
            + \tfrac{1}{\varepsilon}\Big(\sum_{ij}\pi_{ij}\log\pi_{ij} + \sum_j \rho_j\log\rho_j\Big)
        \quad\text{s.t.}\quad \rho_j + \textstyle\sum_i \pi_{ij} = 1/n,\;
        \textstyle\sum_{ij}\pi_{ij} = \mu ,

    solved in the log domain (docs/gsp.md). The unrolled backward is validation only.
``gsp_pool_forward`` / ``gsp_pool_backward`` (GSP Alg. 2, Eqs. 4.1, 4.3; ``_pool.py``)
    pooled feature (GeMean for ``p > 1``) and attribute histogram ``z``.
"""

from refdml.gsp._cost import (
    CostMapContext,
    CostMapGrads,
    cost_map,
    cost_map_backward,
    cost_map_forward,
)
from refdml.gsp._p1 import P1Result, solve_p1_linprog, solve_p1_pot
from refdml.gsp._pool import PoolContext, PoolGrads, gsp_pool, gsp_pool_backward, gsp_pool_forward
from refdml.gsp._transport import (
    WeightTransportGrads,
    WeightTransportResult,
    weight_transport,
    weight_transport_backward,
    weight_transport_backward_unrolled,
)

__all__ = [
    "CostMapContext",
    "CostMapGrads",
    "P1Result",
    "PoolContext",
    "PoolGrads",
    "WeightTransportGrads",
    "WeightTransportResult",
    "cost_map",
    "cost_map_backward",
    "cost_map_forward",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
    "solve_p1_linprog",
    "solve_p1_pot",
    "weight_transport",
    "weight_transport_backward",
    "weight_transport_backward_unrolled",
]
