"""A Snakemake started again attaches to the run's training job that still queues or runs.

The submitting ``snakemake`` (the head) may die while its training job goes on: a dropped
login session, a rebooted login node, a head job cut by its own time limit. Started again
(after ``--unlock``), the SLURM plugin would submit a second training job, which the state
lock refuses (ddppipe.runstate.state_lock) while the first trains on with nobody waiting for
it. :func:`install` wraps the plugin's ``run_job``: for a rule in :data:`RULES`, a live job of
the same rule and wildcards from the same working directory (the plugin submits each job with
``--comment rule_<rule>_wildcards_<values>`` and ``-D <workdir>``) is taken over instead of
submitted: renamed to this head's run id (the plugin asks ``squeue``/``sacct --name <run id>``
for its jobs' states) and reported as submitted, so the plugin's status checks see it end and
the DAG goes on, with no second allocation. A job submitted before one of the job's inputs last
changed (the config edited, ``write_config`` ran again) trains on other inputs: it is not
attached to, and the job fails with a message saying to wait for it or cancel it.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.slurm import scontrol, squeue

log = logging.getLogger(__name__)
RULES = ("train",)  # the rules whose job outlives a head worth waiting for
# squeue states of a job that has not ended yet (or ends now: COMPLETING reports its outcome)
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
    "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED",
})  # fmt: skip
CLOCK_SLACK_S = 2.0  # between the filesystem's clock (inputs' mtimes) and slurmctld's


@dataclass(frozen=True)
class LiveJob:
    """A training job that an earlier head submitted and that has not ended."""

    job_id: str
    state: str


def comment(rule: str, wildcards: Iterable[str]) -> str:
    """The ``--comment`` the SLURM plugin (2.x) gives a job of ``rule`` with ``wildcards``'
    values."""
    values = "_".join(wildcards).replace("/", "_")
    return f"rule_{rule}_wildcards_{values}" if values else f"rule_{rule}"


def live(queued: list[squeue.Queued], wanted_comment: str, workdir: Path) -> list[LiveJob]:
    """The live jobs of ``queued`` with that comment and working directory, oldest first."""
    found = [
        LiveJob(q.job, q.state) for q in queued
        if q.state in LIVE_STATES and q.comment == wanted_comment
        and q.workdir.resolve() == workdir.resolve()
    ]  # fmt: skip
    return sorted(found, key=lambda j: int(j.job_id.split("_")[0]))


def find(wanted_comment: str, workdir: Path) -> LiveJob | None:
    """This user's newest live job with ``wanted_comment`` submitted from ``workdir``; None when
    there is none or squeue cannot say (then the plugin submits as usual)."""
    try:
        queued = squeue.mine()
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("ddppipe: squeue failed (%s): not looking for a job to attach to", e)
        return None
    jobs = live(queued, wanted_comment, workdir)
    if len(jobs) > 1:
        log.warning(
            "ddppipe: %d live jobs %s (%s) from %s; attaching to the newest, %s",
            len(jobs), wanted_comment, ", ".join(j.job_id for j in jobs), workdir,
            jobs[-1].job_id,
        )  # fmt: skip
    return jobs[-1] if jobs else None


class StaleJobError(RuntimeError):
    """The live job was submitted before the job's inputs last changed: it trains other ones."""


def take_over(job_id: str, run_id: str, inputs: Iterable[str | Path] = ()) -> Path | None:
    """Rename the job to ``run_id`` (what the plugin's status checks ask for); its log file
    (the job's StdOut) if scontrol names one. StaleJobError when one of ``inputs`` changed
    after the job's submission."""
    record = scontrol.job_record(job_id)
    submitted = scontrol.timestamp(record.get("SubmitTime", ""))
    limit = (submitted or float("inf")) + CLOCK_SLACK_S
    newer = [str(p) for p in inputs if Path(p).stat().st_mtime > limit]
    if newer:
        raise StaleJobError(
            f"SLURM job {job_id} trains with inputs older than {', '.join(newer)} (changed "
            f"since its submission at {record.get('SubmitTime')}): wait for it to end, or "
            f"stop it (scancel {job_id}), then run snakemake again"
        )
    scontrol.rename(job_id, run_id)
    stdout = record.get("StdOut", "")
    return Path(stdout.replace("%j", job_id)) if stdout else None


def install(executor: type, rules: Iterable[str] = RULES) -> bool:
    """Make ``executor`` (the SLURM plugin's class) attach to a live job of ``rules`` instead
    of submitting another; False, with a warning, when its interface is not the one this was
    written for (then it submits as before)."""
    rules = frozenset(rules)
    original = getattr(executor, "run_job", None)
    if original is None or not hasattr(executor, "report_job_submission"):
        log.warning(
            "ddppipe: %s has no run_job/report_job_submission: a restarted snakemake submits "
            "a second training job instead of attaching to the running one",
            executor.__name__,
        )
        return False
    if getattr(original, "_ddppipe_attach", False):
        return True

    def run_job(self: Any, job: Any) -> None:
        if not job.is_group() and job.name in rules:
            try:
                if _attach(self, job):
                    return
            except Exception as e:  # never lose the job: submit it as the plugin would
                self.logger.warning(
                    f"ddppipe: looking for a SLURM job of rule {job.name} to attach to failed "
                    f"({type(e).__name__}: {e}): submitting a new one"
                )
        original(self, job)

    run_job._ddppipe_attach = True  # type: ignore[attr-defined]
    executor.run_job = run_job
    return True


def _attach(executor: Any, job: Any) -> bool:
    """Take over the live job of ``job``'s rule and wildcards and report it as ``job``'s
    submission; False when there is none or it cannot be taken over."""
    from snakemake_interface_executor_plugins.executors.base import SubmittedJobInfo

    workdir = Path(executor.workflow.workdir_init)
    wildcards = list(job.wildcards or ())
    live = find(comment(job.name, wildcards), workdir)
    if live is None:
        return False
    try:
        logfile = take_over(live.job_id, executor.run_uuid, job.input)
    except StaleJobError as e:
        executor.logger.error(f"ddppipe: {e}")
        report = getattr(executor, "_report_job_error_threadsafe", None)
        (report or executor.report_job_error)(SubmittedJobInfo(job), str(e))
        return True
    except (OSError, subprocess.SubprocessError) as e:
        executor.logger.warning(
            f"ddppipe: cannot take over SLURM job {live.job_id} "
            f"({str(getattr(e, 'stderr', '') or e).strip()}): submitting a new one"
        )
        return False
    if logfile is None:  # the plugin's own path
        logfile = Path(executor.slurm_logdir, f"rule_{job.name}", "_".join(wildcards))
        logfile /= f"{live.job_id}.log"
    executor.logger.info(
        f"ddppipe: attaching to SLURM job {live.job_id} ({live.state}) of rule {job.name} "
        f"(Snakemake job {job.jobid}), submitted by an earlier snakemake from {workdir}: "
        "waiting for it instead of submitting another"
    )
    info = SubmittedJobInfo(job, external_jobid=live.job_id, aux={"slurm_logfile": logfile})
    report = getattr(executor, "_report_job_submission_threadsafe", None)
    (report or executor.report_job_submission)(info)
    return True
