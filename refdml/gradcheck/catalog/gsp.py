"""Catalogue entries of ``refdml.gsp``.

Transitional: the operator module still registers itself through the old shim
``refdml.gradcheck.registry``; its entries move here.
"""

import refdml.gsp  # noqa: F401
