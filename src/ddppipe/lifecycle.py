"""One slot of a training run, start to end: preflight, attempt record, training, what next.

``ddppipe launch`` (the train rule) calls :func:`run`. Its exit status: 0 when training is
complete; :data:`~ddppipe.preemption.EXIT_CODE` (75) when it stopped on a signal after a
checkpoint and goes on (in SLURM: the job has requeued itself, or SLURM requeues it; outside:
run it again); the training's own status when it crashed; 1 when a SLURM run stopped making
progress or reached ``slurm.max_continuations``.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddppipe import atomic, attempts, continuation, launch, preemption, preflight, slurm

log = logging.getLogger(__name__)
NO_PROGRESS_EXIT = 1


def run(cfg: dict[str, Any], train_args: list[str], state: Path, record: Path | None) -> int:
    """Train one slot; ``record`` receives the attempt history when training is complete."""
    plan = launch.plan(cfg, ["train", *train_args])
    restarts = 0
    if plan.job:
        log.info("preflight on %s:\n%s", ",".join(plan.hosts), preflight.run(cfg, plan))
        restarts = int(_job_record(plan.job).get("Restarts", "0") or 0)
    history = attempts.begin(state, plan.job, restarts, plan.hosts)
    log.info("attempt %d of this run; run: %s", len(history), " ".join(plan.command))
    code, note = launch.supervise(plan.command, plan.env, state)
    if code == 0:
        history = attempts.finish(state, "completed", 0)
        log.info("training complete; attempts:\n%s", attempts.table(history))
        if record is not None:
            atomic.write_json(record, [asdict(a) for a in history])
        return 0
    if note is None:
        attempts.finish(state, f"crashed (exit {code})", code)
        return code
    return _stopped(plan, note, state)


def _job_record(job: str) -> dict[str, str]:
    try:
        return slurm.job_record(job)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol show job %s failed (%s)", job, e)
        return {}


def _stopped(plan: launch.Plan, note: dict[str, Any], state: Path) -> int:
    """Training stopped on a signal after writing a checkpoint: record why, then go on."""
    request, job = plan.request, plan.job
    nodes: dict[str, str] = {}
    if job:
        try:
            nodes = slurm.node_states(plan.hosts)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("scontrol show node failed (%s)", e)
    outcome = continuation.classify(
        note.get("signal"), _job_record(job) if job else None, nodes, request.signal_seconds
    )
    history = attempts.finish(state, outcome, preemption.EXIT_CODE)
    log.warning(
        "training stopped (%s) after writing %s; attempts:\n%s",
        outcome, note.get("checkpoint"), attempts.table(history),
    )  # fmt: skip
    if not job:
        return preemption.EXIT_CODE  # run it again to resume
    decision = continuation.decide(history, request.max_continuations)
    if decision.requeue:
        try:
            slurm.requeue(job)
        except (OSError, subprocess.CalledProcessError) as e:
            stderr = getattr(e, "stderr", "") or e
            log.error(
                "could not requeue job %s (%s); exiting %d: Snakemake retries the job, which "
                "uses one of its --retries", job, str(stderr).strip(), preemption.EXIT_CODE,
            )  # fmt: skip
            return preemption.EXIT_CODE
        log.warning("requeued job %s: its next slot resumes from %s", job, note.get("checkpoint"))
        return preemption.EXIT_CODE
    if outcome in continuation.REQUEUED_BY_SLURM:
        log.warning("%s", decision.reason)
        return preemption.EXIT_CODE
    history[-1].detail = decision.reason
    attempts.save(state, history)
    log.error("not continuing: %s", decision.reason)
    return NO_PROGRESS_EXIT
