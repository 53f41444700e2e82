"""Catalogue entries of ``refdml.histogram``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.histogram  # noqa: F401
