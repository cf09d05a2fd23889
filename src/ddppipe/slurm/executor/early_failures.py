"""A training job that fails before its launcher starts: named, and not retried twice.

On SLURM the plugin runs a job's rule inside a Snakemake of its own, which parses the workflow
again and checks the rule's inputs before ``ddppipe launch`` opens an attempt. When that fails
(a config error, a file the node does not see, an import error, the command missing on the
node) the plugin only reports the job's state ("failed ... reason unavailable"), the run has
no attempt that says why, and the profile's ``retries`` submit the same certainty again.

:func:`install` wraps the plugin's ``report_job_error``: for a training job whose SLURM id no
attempt of its run names, it reads the error from the job's log (:func:`error_of_log`),
records it in the run's state folder (:mod:`ddppipe.runstate.prelaunch_failures`: the summary and
the sweep's table show it), puts it first in the message Snakemake prints, and when the job
before failed with the same error (no slot trained between them) makes this failure final:
Snakemake does not retry it (the crash rule of :mod:`ddppipe.runstate.failures`, before
training).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddppipe.runstate import attempts as attempt_history
from ddppipe.runstate import prelaunch_failures
from ddppipe.runstate.state import StateDir

log = logging.getLogger(__name__)
MAX_ERROR = 300  # characters of an error kept
# Snakemake's own error heading: "InputFunctionException in rule write_config in file X, line 1:"
_HEADING = re.compile(r"^(\w+(?:Error|Exception))(?: in rule (\S+))?(?: in file .*)?:\s*$")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)$")
_SHELL = re.compile(r"^(?:/\S+/)?(?:ba)?sh: (?:line \d+: )?(.+)$")  # bash: line 1: x: not found
_NOISE = ("Error:", "Traceback:", "Wildcards:", "Traceback (most recent call last):")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


def _after(lines: list[str], at: int) -> str | None:
    """The first line of substance after ``lines[at]``."""
    for line in lines[at + 1 :]:
        found = line.strip()
        if found and found not in _NOISE:
            return found
    return None


def error_of_log(text: str) -> str | None:
    """The first error a job's log (its inner Snakemake's output) names, as one line: a
    Snakemake error heading with the line under it, a traceback's exception, a shell's
    complaint; None where it names none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        heading = _HEADING.match(line.strip())
        if heading:
            kind, rule = heading.groups()
            where = f" in rule {rule}" if rule else ""
            detail = _after(lines, i)
            return _short(f"{kind}{where}: {detail}" if detail else f"{kind}{where}")
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            tail = next((x for x in lines[i + 1 :] if x and not x[0].isspace()), None)
            if tail and _EXCEPTION.match(tail.strip()):
                return _short(tail)
    for line in lines:
        shell = _SHELL.match(line.strip())
        if shell:
            return _short(shell.group(1))
    return None


def _read(logfile: Any) -> str:
    try:
        return Path(logfile).read_text(errors="replace") if logfile else ""
    except OSError:
        return ""


def note(
    job: Any, job_id: str, logfile: Any, plugin_msg: str | None, state: StateDir
) -> str | None:
    """Record ``job``'s early failure (SLURM job ``job_id``, its log ``logfile``) in the run's
    state folder; the line to print before the plugin's message, None when its launcher had
    started (an attempt names the job: the attempt's outcome tells)."""
    history = attempt_history.load(state)
    if any(a.job == job_id for a in history):
        return None
    text = _read(logfile)
    first = (plugin_msg or "").strip().splitlines()
    error = error_of_log(text) or _short(first[0] if first else "the job ended before training")
    failure = prelaunch_failures.EarlyFailure(
        job_id, time.time(), error, str(logfile) if logfile else None
    )
    found = prelaunch_failures.record(state, failure)
    starts = [a.start for a in history]
    line = f"ddppipe: SLURM job {job_id} of rule {job.name} failed before training: {error}"
    if prelaunch_failures.repeated(found, starts):
        job.attempt = max(job.attempt, job.restart_times + 1)  # Snakemake retries no more
        line += (
            f"\nddppipe: the same error as SLURM job {found[-2].job}: not retried (fix the "
            "cause, then run snakemake again)"
        )
    return line


def install(executor: type, state_of: Callable[[Any], StateDir | None]) -> bool:
    """Make ``executor`` (the SLURM plugin's class) name a training job's early failure;
    False, with a warning, when its interface is not the one this was written for."""
    original = getattr(executor, "report_job_error", None)
    if original is None:
        log.warning(
            "ddppipe: %s has no report_job_error: a job that fails before training is not "
            "named in the summary and is retried as any failure",
            executor.__name__,
        )
        return False
    if getattr(original, "_ddppipe_early_failures", False):
        return True

    def report_job_error(self: Any, job_info: Any, msg: str | None = None, **kwargs: Any) -> Any:
        job = job_info.job
        state = None if job.is_group() else state_of(job)
        if state is not None and job_info.external_jobid:
            try:
                line = note(job, str(job_info.external_jobid),
                            (job_info.aux or {}).get("slurm_logfile"), msg, state)  # fmt: skip
            except Exception as e:  # never lose the plugin's own report
                self.logger.warning(f"ddppipe: reading job {job_info.external_jobid}'s log: {e}")
            else:
                if line:
                    msg = f"{line}\n{msg}" if msg else line
        return original(self, job_info, msg=msg, **kwargs)

    report_job_error._ddppipe_early_failures = True  # type: ignore[attr-defined]
    executor.report_job_error = report_job_error
    return True
