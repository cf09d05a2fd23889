"""The SLURM request of a packed sweep's allocation (``sweep.pack``): its ``sbatch`` line and the
``srun`` step that runs a command once on each of its nodes, built here like every other SLURM
command (the training job's: :mod:`ddppipe.slurm.request`; the head job's:
:mod:`ddppipe.slurm.head`). What the allocation holds (its trials' CPUs, memory and GPUs) and
what runs on its nodes are the pack's (:mod:`ddppipe.packing.allocation`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from ddppipe.settings.run_spec import Slurm
from ddppipe.slurm import sbatch


@dataclass(frozen=True)
class AllocationRequest:
    """One allocation: ``nodes`` nodes, each with one task of ``cpus_per_node`` CPUs,
    ``mem_mb`` and ``gpus_per_node`` GPUs, for ``time_min`` minutes, in the trials' partition,
    account, QOS and features (``slurm``), without the nodes in ``exclude`` (a hostlist; None:
    none)."""

    job_name: str
    nodes: int
    cpus_per_node: int
    mem_mb: int
    gpus_per_node: int
    time_min: int
    slurm: Slurm
    exclude: str | None = None

    def srun(self, command: Sequence[str]) -> list[str]:
        """``command`` as a step of one task on each node with all its CPUs; a task that fails
        leaves the others running (``--kill-on-bad-exit=0``: a node's worker is one of many)."""
        return [
            "srun", f"--nodes={self.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_per_node}", "--kill-on-bad-exit=0", "--export=ALL",
            *command,
        ]  # fmt: skip

    def sbatch(self, command: Sequence[str], output: str, workdir: str) -> list[str]:
        """``sbatch`` of the allocation whose batch script runs ``command`` on each node
        (:meth:`srun`), its output to ``output`` (``%j``: the job id), in ``workdir``."""
        options: dict[str, sbatch.Option] = {
            "--job-name": self.job_name,
            "--nodes": str(self.nodes),
            "--ntasks-per-node": "1",
            "--cpus-per-task": str(self.cpus_per_node),
            "--mem": f"{self.mem_mb}M",
            "--time": str(self.time_min),
            "--partition": self.slurm.partition,
            "--account": self.slurm.account,
            "--qos": self.slurm.qos,
            "--constraint": self.slurm.constraint,
            "--gres": f"gpu:{self.gpus_per_node}" if self.gpus_per_node else None,
            "--exclude": self.exclude,
            "--output": output,
            "--chdir": workdir,
        }
        return sbatch.argv(options, shlex.join(self.srun(command)))
