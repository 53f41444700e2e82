"""Catalogue entries of ``refdml.losses``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.losses  # noqa: F401
