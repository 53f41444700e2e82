"""What the fast path shares with the reference: the explicit internal API (operators layer).

refdml.gpu runs the reference's operators again on NumPy or CuPy arrays, and where the maths
is the same it calls the reference's own helpers (input checks, contexts, closed forms)
instead of a copy. Those helpers are private to their reference modules; the fast path takes
them from here, one module per family (``refdml._shared.gsp``, ``refdml._shared.ot``, ...),
each re-exporting, under names without a leading underscore, exactly what refdml.gpu uses.
A reference module may rename or reshape its private helpers freely as long as its module
here keeps its names; tests/test_architecture.py holds refdml.gpu to importing from the
operators layer only public names of public modules and the modules of this package.

Internal: not part of refdml's public API, and not documented on the site beyond this page.
"""
