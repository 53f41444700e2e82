"""Catalogue entries of ``refdml.distances``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.distances  # noqa: F401
