"""The claim modules; each registers its checks in :data:`._framework.CHECKS` on import."""

from __future__ import annotations

__all__ = ["CLAIM_MODULES", "load_claims"]

# Documents the registration order, which is the order of ``refdml verify`` and of its
# report; load_claims imports the modules statically in this same order.
CLAIM_MODULES = (
    "refdml.validation.claims_xml",
    "refdml.validation.claims_gsp",
    "refdml.validation.claims_gsp_supp",
    "refdml.validation.claims_asap",
    "refdml.validation.claims_wdml",
)


def load_claims() -> None:
    """Import the claim modules (each registers its checks on import)."""
    # Function-local so that ``import refdml.validation`` (and ``refdml verify --help``)
    # stays light: the claim modules pull in SciPy, POT, hypothesis and the operators.
    # Keep the names in the order of CLAIM_MODULES: it is the registration order.
    from . import claims_xml, claims_gsp, claims_gsp_supp, claims_asap, claims_wdml  # noqa: F401
