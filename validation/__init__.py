"""Numerical checks of the claims of the four papers (installed as ``refdml.validation``)."""
