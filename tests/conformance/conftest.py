"""Fixtures shared by the conformance tests."""

import pytest


@pytest.fixture
def jax_first():
    """JAX, imported before ``pytester`` (an argument after this one) snapshots
    ``sys.modules``: pytester drops what the test imported, and JAX imported a second time in
    one process aborts it (jaxlib's "SetTimeZone() has already been called"). A test that
    runs JAX under pytester takes this fixture first, so that its outcome does not depend on
    which test imported JAX before it (run alone, in another order, or under xdist)."""
    return pytest.importorskip("jax")
