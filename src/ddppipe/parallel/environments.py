"""Who am I in the job? One small class per launcher, each answering the same questions.

The chooser :func:`detect` tries them in a fixed order: torchrun first (it also runs
inside SLURM and sets its own ranks), then MPI launchers (``mpirun`` inside an allocation
also sees SLURM variables of the batch step), then SLURM ``srun``, then a plain process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import hostlist

from ddppipe.core.errors import UserError
from ddppipe.core.rendezvous import first_host, job_port, step_nodelist

DEFAULT_PORT = 29500


class LauncherEnvError(RuntimeError, UserError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class ProcessEnvironment:
    """Base class: rank, local rank, world size and rendezvous address of this process."""

    env: Mapping[str, str]
    name: ClassVar[str] = "base"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def _int(self, key: str) -> int:
        try:
            return int(self.env[key])
        except KeyError as e:
            raise LauncherEnvError(f"{self.name}: environment variable {key} is not set") from e
        except ValueError as e:
            raise LauncherEnvError(f"{self.name}: {key}={self.env[key]!r} is not an integer") from e

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def local_rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def local_world_size(self) -> int | None:
        """Processes on this node, when the launcher says (None when it does not)."""
        return None

    def _optional_int(self, *keys: str) -> int | None:
        for key in keys:
            if key in self.env:
                return self._int(key)
        return None

    @property
    def master_addr(self) -> str:
        if "MASTER_ADDR" in self.env:
            return self.env["MASTER_ADDR"]
        nodelist = step_nodelist(self.env)
        if nodelist:
            return first_host(nodelist)
        if self.world_size == 1:
            return "127.0.0.1"
        raise LauncherEnvError(
            f"{self.name}: cannot tell the rendezvous host: set MASTER_ADDR to the host of rank 0"
        )

    @property
    def master_port(self) -> int:
        return int(self.env.get("MASTER_PORT", DEFAULT_PORT))

    def describe(self) -> str:
        return (
            f"{self.name}: rank {self.rank}/{self.world_size} (local {self.local_rank}), "
            f"rendezvous {self.master_addr}:{self.master_port}"
        )


class TorchElastic(ProcessEnvironment):
    """``torchrun`` (torch.distributed.elastic): RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or all(
            k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        )

    @property
    def rank(self) -> int:
        return self._int("RANK")

    @property
    def local_rank(self) -> int:
        return self._int("LOCAL_RANK")

    @property
    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    @property
    def local_world_size(self) -> int | None:
        return self._optional_int("LOCAL_WORLD_SIZE")


class OpenMPI(ProcessEnvironment):
    """Open MPI's ``mpirun``: OMPI_COMM_WORLD_*."""

    name = "openmpi"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env

    @property
    def rank(self) -> int:
        return self._int("OMPI_COMM_WORLD_RANK")

    @property
    def local_rank(self) -> int:
        return self._int("OMPI_COMM_WORLD_LOCAL_RANK")

    @property
    def world_size(self) -> int:
        return self._int("OMPI_COMM_WORLD_SIZE")

    @property
    def local_world_size(self) -> int | None:
        return self._optional_int("OMPI_COMM_WORLD_LOCAL_SIZE")


class PMI(ProcessEnvironment):
    """MPICH / Intel MPI (Hydra) and other PMI launchers: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID."""

    name = "pmi"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return "PMI_RANK" in env and "PMI_SIZE" in env

    @property
    def rank(self) -> int:
        return self._int("PMI_RANK")

    @property
    def local_rank(self) -> int:
        for key in ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"):
            if key in self.env:
                return self._int(key)
        raise LauncherEnvError("pmi: no local rank (MPI_LOCALRANKID or PMI_LOCAL_RANK) is set")

    @property
    def world_size(self) -> int:
        return self._int("PMI_SIZE")

    @property
    def local_world_size(self) -> int | None:
        return self._optional_int("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")


class Slurm(ProcessEnvironment):
    """A task of a SLURM ``srun`` step: SLURM_PROCID, SLURM_LOCALID, SLURM_(STEP_)NTASKS."""

    name = "slurm"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return (
            "SLURM_PROCID" in env
            and "SLURM_LOCALID" in env
            and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env)
        )

    @property
    def rank(self) -> int:
        return self._int("SLURM_PROCID")

    @property
    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID")

    @property
    def world_size(self) -> int:
        key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in self.env else "SLURM_NTASKS"
        return self._int(key)

    @property
    def local_world_size(self) -> int | None:
        """This node's tasks, from ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``4(x2),3``)."""
        per_node = self.env.get("SLURM_STEP_TASKS_PER_NODE") or self.env.get("SLURM_TASKS_PER_NODE")
        nodelist = step_nodelist(self.env)
        node = self.env.get("SLURMD_NODENAME")
        if not per_node or not nodelist:
            return None
        counts = [
            int(m[1]) for m in re.finditer(r"(\d+)(?:\(x(\d+)\))?", per_node)
            for _ in range(int(m[2] or 1))
        ]  # fmt: skip
        hosts = hostlist.expand_hostlist(nodelist)
        if node in hosts and len(counts) == len(hosts):
            return counts[hosts.index(node)]
        return counts[0] if len(set(counts)) == 1 else None

    @property
    def master_port(self) -> int:
        if "MASTER_PORT" in self.env:
            return int(self.env["MASTER_PORT"])
        return job_port(self._int("SLURM_JOB_ID"))


class Single(ProcessEnvironment):
    """A plain single process: rank 0 of 1."""

    name = "single"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def local_world_size(self) -> int | None:
        return 1


ORDER: tuple[type[ProcessEnvironment], ...] = (TorchElastic, OpenMPI, PMI, Slurm, Single)


def detect(env: Mapping[str, str]) -> ProcessEnvironment:
    """The first environment of :data:`ORDER` that applies, checked for consistency."""
    for cls in ORDER:
        if cls.detect(env):
            found = cls(dict(env))
            if not 0 <= found.rank < found.world_size:
                raise LauncherEnvError(
                    f"{found.name}: rank {found.rank} is outside world size {found.world_size}"
                )
            return found
    raise AssertionError("Single always applies")
