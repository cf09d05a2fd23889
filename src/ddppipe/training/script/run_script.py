"""``python -m ddppipe.training.script.run_script SCRIPT [ARGS...]``: a user's torchrun script
run as ``python SCRIPT ARGS`` runs it (``__main__``, its folder first on ``sys.path``), its
failure recorded for the launcher (:func:`ddppipe.runstate.failures.record`): a script's
``main`` is not ours to decorate. Every script run (locally and under torchrun's agent) starts here.
"""

from __future__ import annotations

import os
import runpy
import sys

from ddppipe.runstate import failures


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` with the arguments ``argv[1:]``; record an exception, then re-raise it."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as e:
        failures.record(e)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
