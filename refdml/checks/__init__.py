"""``refdml gradcheck`` and ``refdml gpu-check``: the catalogue's checks, run from the command line.

Two subcommands of the apps layer, one module each, with the face every subcommand has
(``HELP``, ``DESCRIPTION``, ``EPILOG``, ``add_arguments(parser)``, ``run(args) -> int``;
wired by :mod:`refdml.cli`):

* ``_gradcheck_cli.py``: every catalogued backward against central finite differences
  (:mod:`refdml.gradcheck` over :func:`refdml.catalog.all_operators`);
* ``_gpu_check_cli.py``: every mirrored entry's parity against the reference
  (:mod:`refdml.gradcheck.parity`), or with ``--compile-only`` every CUDA kernel compiled for
  real GPUs (:mod:`refdml.gpu._compile_check`).

They sit above the catalogue, which they read, as ``refdml verify`` and ``refdml conform``
do; the catalogue itself holds entries, not commands.
"""
