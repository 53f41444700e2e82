"""Run Python in a child process where some installed modules look absent.

A meta-path finder placed first refuses every module whose top-level name is in the
comma-separated ``sys.argv[1]`` of the child, as an install without them would:
``import numba`` raises ``ModuleNotFoundError`` naming it. The tests of the optional extras
(tests/cli/test_extras.py) and of the reference without Numba (tests/test_optional_numba.py)
run their code this way.
"""

from __future__ import annotations

import sys
import textwrap

#: Run first in the child: refuses the top-level modules named by ``sys.argv[1]``.
REFUSE_MODULES = textwrap.dedent("""
    import sys

    BLOCKED = set(filter(None, sys.argv[1].split(",")))


    class Refuse:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, Refuse)
""")


def child_argv(body: str, blocked: str, *args: str) -> list[str]:
    """The command line that runs ``body`` (dedented) with the modules in ``blocked`` (comma
    separated top-level names) refused; ``args`` follow as ``sys.argv[2:]``."""
    return [sys.executable, "-c", REFUSE_MODULES + textwrap.dedent(body), blocked, *args]
