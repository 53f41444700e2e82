"""Without torch, ``import refdml.torch`` is one line naming the extra (refdml's
MissingExtraError), not a traceback from deep inside."""

from __future__ import annotations

import subprocess
import sys


def test_refdml_torch_without_torch_names_its_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from refdml.exceptions import MissingExtraError\n"
            "try:\n    import refdml.torch\n"
            "except MissingExtraError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ('needs the "torch" extra (torch is not installed): '
                                   'pip install "refdml[torch]"')
