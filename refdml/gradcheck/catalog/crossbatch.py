"""Catalogue entries of ``refdml.crossbatch``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.crossbatch  # noqa: F401
