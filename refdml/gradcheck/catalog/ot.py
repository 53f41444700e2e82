"""Catalogue entries of ``refdml.ot``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.ot  # noqa: F401
