"""``python -m ddppipe.training.script.run_script SCRIPT [ARGS...]``: a user's torchrun script
run as ``python SCRIPT ARGS`` runs it (``__main__``, its folder first on ``sys.path``), its
failure recorded for the launcher (:func:`ddppipe.runstate.failures.record`): a script's
``main`` is not ours to decorate. Every script run (locally and under torchrun's agent) starts here.
In a SLURM slot of its own, its node's devices are checked first
(:func:`ddppipe.parallel.node_check.before_joining`); the script joins its own process group,
so the world's checks are ``ddppipe preflight``'s only.
"""

from __future__ import annotations

import os
import runpy
import sys

from ddppipe.core import slot
from ddppipe.parallel import node_check
from ddppipe.runstate import failures

JOIN_TIMEOUT_S = 600  # the ranks' wait for each other's node checks (torch's default timeout)


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` with the arguments ``argv[1:]``; record an exception, then re-raise it."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    found = slot.read()
    try:
        if found is not None and found.checks:  # a SLURM slot of its own
            use = "gpu" if found.device == "gpu" else "cpu"
            node_check.before_joining(use, "fp32", JOIN_TIMEOUT_S)
        runpy.run_path(script, run_name="__main__")
    except node_check.NodeUnfit as e:  # its node said why (the launcher reads it): no traceback
        failures.record(e)
        sys.exit(node_check.EXIT_CODE)
    except BaseException as e:
        failures.record(e)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
