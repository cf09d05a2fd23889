"""The ``sbatch`` command lines of the jobs ddppipe submits itself (the head job, a packed
sweep's allocations), built one way, and their submission."""

from __future__ import annotations

from collections.abc import Mapping

from ddppipe.slurm.runner import run

Option = str | bool | None  # a value; True: a flag without one; None, False: left out


class SbatchError(RuntimeError):
    """sbatch refused a job; the message is its error output."""


def argv(options: Mapping[str, Option], wrap: str) -> list[str]:
    """``sbatch --parsable``, ``options`` in their order (``--key=value``), ``--wrap wrap``."""
    given = [key if value is True else f"{key}={value}" for key, value in options.items()
             if value is not None and value is not False]  # fmt: skip
    return ["sbatch", "--parsable", *given, "--wrap", wrap]


def submit(command: list[str], timeout: float) -> str:
    """Submit an :func:`argv` command line; the job's id. SbatchError when sbatch refuses."""
    done = run(command, timeout=timeout)
    if done.returncode != 0:
        raise SbatchError(done.stderr.strip())
    return done.stdout.strip().split(";")[0]
