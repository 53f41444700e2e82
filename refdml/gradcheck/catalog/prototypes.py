"""Catalogue entries of ``refdml.prototypes``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.prototypes  # noqa: F401
