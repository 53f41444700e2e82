"""Catalogue entries of ``refdml.normalize``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.normalize  # noqa: F401
