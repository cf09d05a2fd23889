"""The subcommands that run as a rank under torchrun: they exit without finalization."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn


def train(config_path: Path, data: Path, state: Path, checkpoint: Path, metrics: Path) -> NoReturn:
    """``ddppipe train``: one training process (started by torchrun/srun/mpirun)."""
    from ddppipe.core import env_names
    from ddppipe.runstate import failures, preemption

    # First, before torch loads: a stop signal from now on is noted, never lost or fatal.
    guard = preemption.Guard()
    from ddppipe.parallel import node_check
    from ddppipe.training.measuring import heartbeat

    heartbeat.start()  # from now on the launcher's hang watchdog sees this rank's progress
    try:
        from ddppipe.core import process_times
        from ddppipe.runstate.state import StateDir
        from ddppipe.settings import run_spec
        from ddppipe.training.loop import files, train

        process_times.mark("imported")  # (torch and the training's modules)
        paths = files.Paths(data, StateDir(state), checkpoint, metrics)
        train.train(run_spec.load(config_path), paths, guard)
    except preemption.Preempted as e:
        logging.getLogger("ddppipe").warning("%s", e)
        code = 0 if os.environ.get(env_names.UNDER_AGENT) else preemption.EXIT_CODE
    except failures.NonFiniteLoss as e:  # every rank stops at once: a line, no traceback
        failures.record(e)
        logging.getLogger("ddppipe").error("training stopped: %s", e)
        code = 1
    except node_check.NodeUnfit as e:  # its node said why (the launcher reads it): no traceback
        failures.record(e)
        code = node_check.EXIT_CODE
    except BaseException as e:
        failures.record(e)  # for the launcher: this rank's exception and the user's frame
        raise
    else:
        code = 0
    finally:
        guard.restore()
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Exit with ``code`` now, without the interpreter's finalization.

    A worker gets here with its outputs written and the process group left. Finalization
    would only free torch's objects, and a gloo rank once aborted there (SIGABRT, "terminate
    called without an active exception", CI 2026-11-23) after a complete training: its
    agent then failed the slot and killed the other rank.
    """
    from ddppipe.training.measuring import heartbeat

    heartbeat.done()  # (os._exit runs no atexit handler)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def preflight_allreduce(use: str, precision: str, peak_out: Path | None, nodes: int) -> NoReturn:
    """``ddppipe preflight-allreduce``: all-reduce, bandwidth and GEMM peak on this rank."""
    from ddppipe.launching import preflight

    print(f"preflight: {preflight.allreduce(use, precision, peak_out, nodes)}", flush=True)
    _exit_now(0)  # a gloo rank like the training's (train)
