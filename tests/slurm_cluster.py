"""A real two-node SLURM cluster on this one machine, for tests.

``SlurmCluster`` starts genuine Slurm daemons (Debian's slurm-wlm 22.05) with a
private configuration under a work directory:

* ``munged`` with its own key and socket (a filesystem socket, so reachable from
  every network namespace);
* compute nodes (by default ``node1`` and ``node2``; any names, e.g. the hostlist
  ``cn[07-09]``): each a network namespace (own IP on a private bridge), a UTS
  namespace (own hostname) and a mount namespace (the cluster's config dir on
  /etc/slurm) running one ``slurmd``;
* partitions and any ``slurm.conf`` setting (preemption mode, ``JobRequeue``,
  ``MinJobAge``, ...) as the test asks, so tests can run on clusters shaped
  unlike the default one;
* ``slurmctld`` on the host end of the bridge, in its own UTS namespace whose
  hostname matches ``SlurmctldHost``;
* with ``accounting=True``: MariaDB (Unix socket only) and ``slurmdbd``, so that
  ``sacct`` works.

The nodes share the host's filesystem, users and process table; only network,
hostname and /etc/slurm differ. So a job sees the same Python, checkout and work
directory as the test that submitted it.

Traffic only flows over loopback and the private bridge 10.77.0.0/24 made
here; the namespaces have no default route.

Only one cluster can run on a machine at a time (fixed addresses, ports and
namespace names). ``start()`` first removes whatever a crashed earlier run left
behind; ``stop()`` is safe at any point, also after a partial start.

Install the packages with ``.ci/install_slurm.sh`` (Debian 12, as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

# Fixed network layout: one bridge, the host on .1, the nodes on .11 and .12.
BRIDGE = "ddpslurm0"
PREFIX_LEN = 24
HOST_ADDR = "10.77.0.1"
NODE_ADDRS: dict[str, str] = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
FIRST_NODE_ADDR = 11  # the nodes get 10.77.0.11, .12, ... in order
CTLD_HOSTNAME = "slurmctl"
CLUSTER_NAME = "ddppipe"
PARTITION = "debug"
URGENT_PARTITION = "urgent"
PREEMPT_GRACE_S = 10
# Non-default ports, so that a system Slurm on the default ones is left alone.
CTLD_PORT = 16817
SLURMD_PORT = 16818
DBD_PORT = 16819

HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# ddppipe-slurm-test-cluster"
# Survives a crashed test run (not a reboot): what to clean up next time.
STATE_FILE = Path("/run/ddppipe-slurm-cluster/processes.json")
SBIN_PATH = "/usr/sbin:/sbin"
# Where Slurm commands look without $SLURM_CONF; the nodes see the cluster's here.
SYSTEM_CONF_DIR = Path("/etc/slurm")
LOG_TAIL_LINES = 25
FINISHED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
     "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)  # fmt: skip


class SlurmClusterError(RuntimeError):
    """The test cluster could not be started (the message has the daemons' log tails)."""


class _Layout:
    """Every path the cluster uses, all below one work directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.etc = root / "etc"
        self.slurm_conf = self.etc / "slurm.conf"
        self.gres_conf = self.etc / "gres.conf"
        self.slurmdbd_conf = self.etc / "slurmdbd.conf"  # slurmdbd wants it next to slurm.conf
        self.munge = root / "munge"
        self.munge_key = self.munge / "munge.key"
        self.munge_socket = self.munge / "munge.socket"
        self.ctld = root / "ctld"
        self.state_save = self.ctld / "state"
        self.nodes = root / "nodes"
        self.dev = root / "dev"
        self.db = root / "db"
        self.db_socket = self.db / "mysqld.sock"
        self.logs = root / "logs"

    def log(self, name: str) -> Path:
        return self.logs / name


class SlurmCluster:
    """A two-node SLURM cluster (``node1``, ``node2``) for tests; also a context manager.

    Client commands (``sbatch``, ``srun``, ``squeue``, ``sacct``, ``scontrol``)
    need :attr:`env` in their environment; :meth:`run` adds it. Jobs inherit
    ``SLURM_CONF`` from the submitting environment (``--export=ALL``, the
    default), so ``srun``/``scontrol`` inside jobs work too.
    """

    def __init__(
        self,
        workdir: Path,
        accounting: bool = False,
        gpus_per_node: int = 2,
        cpus_per_node: int = 2,
        memory_mb: int = 20000,  # (SlurmdParameters=config_overrides: not checked)
        start_timeout: float = 60.0,
        nodes: Sequence[str] = tuple(NODE_ADDRS),
        partitions: Mapping[str, str] | None = None,
        settings: Mapping[str, str | None] | None = None,
    ) -> None:
        """``partitions``: name -> attributes of its PartitionName line (all nodes in each
        unless they name its ``Nodes=``; by default a default ``debug`` partition that
        ``urgent`` preempts by requeueing);
        ``settings``: slurm.conf keys to set or replace, e.g. ``{"JobRequeue": "0"}``; None
        removes the key, e.g. ``{"SchedulerParameters": None}`` for Slurm's default scheduler
        intervals (sched_interval 60 s, bf_interval 30 s) instead of the tests' quick ones."""
        self.workdir = Path(workdir).resolve()
        self.accounting = accounting
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.memory_mb = memory_mb
        self.start_timeout = start_timeout
        self.cluster_name = CLUSTER_NAME
        self.partitions: dict[str, str] = dict(partitions or DEFAULT_PARTITIONS)
        self.partition = next(  # the default partition
            (n for n, attrs in self.partitions.items() if "Default=YES" in attrs), PARTITION
        )
        self.urgent_partition = URGENT_PARTITION  # PriorityTier above, preempts `partition`
        self.preempt_grace_s = PREEMPT_GRACE_S
        self.settings: dict[str, str | None] = dict(settings or {})
        self.nodes: list[str] = list(nodes)
        self.node_addrs: dict[str, str] = {
            node: f"10.77.0.{FIRST_NODE_ADDR + i}" for i, node in enumerate(self.nodes)
        }
        self.controller_addr = HOST_ADDR
        self.start_seconds = 0.0
        self._paths = _Layout(self.workdir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ API

    @property
    def conf_path(self) -> Path:
        """The cluster's ``slurm.conf``."""
        return self._paths.slurm_conf

    @property
    def env(self) -> dict[str, str]:
        """Variables to add to a client command's environment (not a full environ)."""
        return {"SLURM_CONF": str(self._paths.slurm_conf)}

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A full environment: ``os.environ`` plus :attr:`env` plus ``extra``."""
        return {**os.environ, **self.env, **(extra or {})}

    def slurmd_pid(self, node: str) -> int:
        """The pid of ``node``'s slurmd (every job step on the node is its descendant)."""
        proc = self._procs.get(f"slurmd-{node}")
        if proc is None or proc.poll() is not None:
            raise SlurmClusterError(f"slurmd on {node} is not running")
        return proc.pid

    @property
    def running(self) -> bool:
        """Whether this object's daemons are up (after ``start()``, before ``stop()``)."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def start(self) -> Self:
        """Clean stale state, start every daemon, and wait until both nodes are idle."""
        started = time.monotonic()
        self.stop()  # this object's earlier run, if any, and any crashed run's leftovers
        check_ports_free()
        try:
            self._prepare_files()
            setup_network(self.node_addrs)
            self._start_munge()
            if self.accounting:
                self._start_mariadb()
                self._start_slurmdbd()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self._wait(self._nodes_idle, "both nodes idle in sinfo")
            if self.accounting:
                self._wait(self._cluster_registered, "the cluster registered in slurmdbd")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Kill every daemon and job; remove namespaces, bridge and hosts entries."""
        for node in self.nodes:
            kill_pids(netns_pids(node))
        stop_processes(list(self._procs.values()))
        self._procs.clear()
        cleanup_stale_state(self.nodes)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        check: bool = True,
        timeout: float = 120.0,
        node: str | None = None,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` (a string goes to ``bash -c``) with the cluster's environment.

        With ``node``, it runs in that node's network, UTS and mount namespaces,
        like a process on that node outside any job. Output is captured as text.
        It runs in ``cwd``, by default the work directory (where a bare
        ``sbatch`` leaves its ``slurm-JOBID.out``).
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if node is not None:
            argv = [*self._node_nsenter(node), *argv]
        result = subprocess.run(
            argv,
            env=self.environ(env),
            cwd=cwd or self.workdir,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, argv, result.stdout, result.stderr
            )
        return result

    def sbatch(self, *args: str, script: str | None = None) -> int:
        """``sbatch --parsable ARGS`` (``script`` on stdin if given); return the job id."""
        result = self.run(["sbatch", "--parsable", *args], input=script)
        return int(result.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        """The job's state in slurmctld (``PENDING``, ``RUNNING``, ...); ``""`` if unknown."""
        result = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        match = re.search(r"\bJobState=(\S+)", result.stdout)
        return match.group(1) if match else ""

    def wait_job(
        self, job_id: int, states: Sequence[str] = ("COMPLETED",), timeout: float = 60.0
    ) -> str:
        """Wait until the job is in one of ``states`` or has finished; return its state."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states or state in FINISHED_STATES:
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {state or 'unknown'} after {timeout:.0f}s")

    def logs_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of every daemon log, for error messages."""
        chunks = []
        for log in sorted(self._paths.logs.glob("*")):
            out = log.with_suffix(".out")
            if log.suffix == ".log" and out.exists() and out.stat().st_size:
                continue  # a foreground daemon's stderr (.out) repeats its log file
            text = log.read_text(errors="replace").splitlines()[-lines:]
            chunks.append(f"==> {log} <==\n" + "\n".join(text))
        return "\n".join(chunks) or "(no logs)"

    # ----------------------------------------------------------- files

    def _prepare_files(self) -> None:
        """Fresh state, spool and log dirs; configs; munge key; fake GPU devices."""
        p = self._paths
        for stale in (p.state_save, p.nodes, p.db, p.logs, p.munge):
            shutil.rmtree(stale, ignore_errors=True)
        for folder in (p.etc, p.state_save, p.dev, p.logs, p.munge):
            folder.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (p.nodes / node / "spool").mkdir(parents=True)
        SYSTEM_CONF_DIR.mkdir(exist_ok=True)  # the nodes' bind-mount target
        p.munge.chmod(0o755)  # clients reach the socket; the key itself is 0400
        make_munge_key(p.munge_key)
        gpus = [make_fake_gpu(p.dev / f"nvidia{i}") for i in range(self.gpus_per_node)]
        p.slurm_conf.write_text(self._slurm_conf())
        p.gres_conf.write_text(gres_conf(self.nodes, gpus))
        if self.accounting:
            p.slurmdbd_conf.write_text(self._slurmdbd_conf())
            p.slurmdbd_conf.chmod(0o600)  # slurmdbd refuses a readable one

    def _slurm_conf(self) -> str:
        p = self._paths
        node_list = ",".join(self.nodes)
        partitions = "\n".join(  # every node, unless the attributes name the partition's own
            f"PartitionName={name} {attrs if 'Nodes=' in attrs else f'Nodes={node_list} {attrs}'}"
            for name, attrs in self.partitions.items()
        )
        text = SLURM_CONF_TEMPLATE.format(
            cluster=CLUSTER_NAME,
            ctld_host=CTLD_HOSTNAME,
            host_addr=HOST_ADDR,
            ctld_port=CTLD_PORT,
            slurmd_port=SLURMD_PORT,
            munge_socket=p.munge_socket,
            state_save=p.state_save,
            ctld_dir=p.ctld,
            nodes_dir=p.nodes,
            logs=p.logs,
            accounting=self._accounting_lines(),
            node_lines="\n".join(self._node_line(n) for n in self.nodes),
            partitions=partitions,
        )
        for key, value in self.settings.items():
            if value is None:  # back to Slurm's default: no line
                text = re.sub(rf"(?m)^{key}=.*\n", "", text)
                continue
            line = f"{key}={value}"
            text, found = re.subn(rf"(?m)^{key}=.*$", line, text)
            if not found:
                text += line + "\n"
        return text

    def _accounting_lines(self) -> str:
        if not self.accounting:
            return "AccountingStorageType=accounting_storage/none"
        # For the slurmctld -> slurmdbd connection AuthInfo is not used: with
        # accounting_storage/slurmdbd, AccountingStoragePass is the munge socket.
        return (
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=localhost\nAccountingStoragePort={DBD_PORT}\n"
            f"AccountingStoragePass={self._paths.munge_socket}"
        )

    def _node_line(self, node: str) -> str:
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        return (
            f"NodeName={node} NodeAddr={self.node_addrs[node]} NodeHostname={node}"
            f" CPUs={self.cpus_per_node} Boards=1 SocketsPerBoard=1"
            f" CoresPerSocket={self.cpus_per_node} ThreadsPerCore=1"
            f" RealMemory={self.memory_mb}{gres} State=UNKNOWN"
        )

    def _slurmdbd_conf(self) -> str:
        return SLURMDBD_CONF_TEMPLATE.format(
            munge_socket=self._paths.munge_socket,
            dbd_port=DBD_PORT,
            log=self._paths.log("slurmdbd.log"),
            pid=self._paths.ctld / "slurmdbd.pid",
        )

    # ----------------------------------------------------------- daemons

    def _spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Start a foreground daemon (output to logs/NAME.out) and record it for cleanup."""
        path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
        with self._paths.log(f"{name}.out").open("ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PATH": path, **(env or {})},
                start_new_session=True,  # a Ctrl-C in pytest must not hit them first
            )
        self._procs[name] = proc
        # The wrappers (unshare, nsenter, sh) exec into the daemon NAME[-node].
        record_process(name, proc.pid, program=name.split("-")[0], marker=str(self.workdir))

    def _start_munge(self) -> None:
        p = self._paths
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--key-file={p.munge_key}",
            f"--socket={p.munge_socket}", f"--pid-file={p.munge / 'munged.pid'}",
            f"--log-file={p.log('munged.log')}", f"--seed-file={p.munge / 'munged.seed'}",
        ])  # fmt: skip
        self._wait(lambda: self._alive("munged") and p.munge_socket.is_socket(), "munged")

    def _start_mariadb(self) -> None:
        """A throw-away MariaDB: fresh datadir, Unix socket only, root via socket auth."""
        p = self._paths
        common = [
            "--no-defaults", "--user=root", f"--datadir={p.db / 'data'}",
            # Small redo log: initialising a 64M one costs seconds on a slow disk.
            "--innodb-log-file-size=8M", "--innodb-buffer-pool-size=128M",
            "--innodb-lock-wait-timeout=900",
        ]  # fmt: skip
        init = subprocess.run(
            ["mariadb-install-db", *common, "--auth-root-authentication-method=socket",
             "--skip-test-db"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if init.returncode != 0:
            raise SlurmClusterError(f"mariadb-install-db failed:\n{init.stdout}{init.stderr}")
        self._spawn("mariadbd", [
            "mariadbd", *common, "--skip-networking", f"--socket={p.db_socket}",
            f"--pid-file={p.db / 'mariadbd.pid'}", f"--log-error={p.log('mariadb.log')}",
        ])  # fmt: skip
        self._wait(lambda: self._alive("mariadbd") and p.db_socket.is_socket(), "mariadbd")

    def _start_slurmdbd(self) -> None:
        # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF. libmariadb
        # takes its default socket from MYSQL_UNIX_PORT (so no TCP to the database).
        env = {"SLURM_CONF": str(self._paths.slurm_conf),
               "MYSQL_UNIX_PORT": str(self._paths.db_socket)}  # fmt: skip
        self._spawn("slurmdbd", ["slurmdbd", "-D"], env=env)
        self._wait(lambda: self._alive("slurmdbd") and port_listening(DBD_PORT), "slurmdbd")

    def _start_slurmctld(self) -> None:
        """slurmctld checks that its hostname is SlurmctldHost: give it its own UTS ns."""
        daemon = shlex.join(["slurmctld", "-D", "-i", "-f", str(self._paths.slurm_conf)])
        script = f"hostname {CTLD_HOSTNAME} && exec {daemon}"
        self._spawn("slurmctld", ["unshare", "--uts", "--", "sh", "-c", script])
        self._wait(lambda: self._alive("slurmctld") and port_listening(CTLD_PORT), "slurmctld")

    def _start_slurmd(self, node: str) -> None:
        """``slurmd -N node`` in the node's netns plus new UTS and mount namespaces.

        ``nsenter`` rather than ``ip netns exec``: the latter remounts /sys, and
        slurmd then fails on cgroups. In the node's own mount namespace the
        cluster's config dir is bind-mounted on /etc/slurm, so that Slurm
        commands in jobs find it even without $SLURM_CONF (snakemake's jobstep
        executor strips every SLURM_* variable before its srun); the host's
        /etc/slurm is left alone.
        """
        daemon = shlex.join(["slurmd", "-D", "-N", node, "-f", str(self._paths.slurm_conf)])
        bind = shlex.join(["mount", "--bind", str(self._paths.etc), str(SYSTEM_CONF_DIR)])
        script = f"hostname {node} && {bind} && exec {daemon}"
        self._spawn(f"slurmd-{node}", [
            "nsenter", f"--net=/run/netns/{node}", "--",
            "unshare", "--uts", "--mount", "--", "sh", "-c", script,
        ])  # fmt: skip

    def _node_nsenter(self, node: str) -> list[str]:
        pid = self.slurmd_pid(node)
        return ["nsenter", f"--target={pid}", "--net", "--uts", "--mount", "--"]

    # ----------------------------------------------------------- readiness

    def _alive(self, name: str) -> bool:
        """True while the daemon runs; raises with the logs once it has exited."""
        proc = self._procs[name]
        if proc.poll() is not None:
            raise SlurmClusterError(
                f"{name} exited with status {proc.returncode} during start-up\n" + self.logs_tail()
            )
        return True

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready`` until true; on timeout raise with the daemons' log tails."""
        deadline = time.monotonic() + self.start_timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"timed out after {self.start_timeout:.0f}s waiting for {what}\n"
                    + self.logs_tail()
                )
            time.sleep(0.1)

    def _nodes_idle(self) -> bool:
        for node in self.nodes:
            self._alive(f"slurmd-{node}")
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=15)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def _cluster_registered(self) -> bool:
        result = self.run(
            ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], check=False, timeout=15
        )
        return CLUSTER_NAME in result.stdout.split()


# --------------------------------------------------------------- configs

SLURM_CONF_TEMPLATE = """\
# Generated by tests/slurm_cluster.py: a two-node test cluster on one machine.
ClusterName={cluster}
SlurmctldHost={ctld_host}({host_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the restart of a requeued job (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={state_save}
SlurmdSpoolDir={nodes_dir}/%n/spool
SlurmctldPidFile={ctld_dir}/slurmctld.pid
SlurmdPidFile={nodes_dir}/%n/slurmd.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here: plain process tracking, no task binding, no usage sampling.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
# Trust the declared CPUs/memory although both nodes share the machine's cores.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
# Reject impossible requests at submit time instead of leaving them pending.
EnforcePartLimits=ALL
# Keep finished jobs in squeue/scontrol for 5 minutes (status without sacct).
MinJobAge=300
# Batch jobs are requeueable unless submitted with --no-requeue.
JobRequeue=1
# Preemption: jobs in the urgent partition requeue jobs in the default one.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# At preemption, send the job's --signal (e.g. B:USR1@60) at once, then GraceTime.
SlurmctldParameters=preempt_send_user_signal
# Quick tests: short kill wait, frequent scheduling, nodes back on registration.
KillWait=5
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
JobCompType=jobcomp/none
MailProg=/bin/true
{accounting}
{node_lines}
{partitions}
"""

DEFAULT_PARTITIONS = {
    PARTITION: "Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE "
    f"GraceTime={PREEMPT_GRACE_S}",
    URGENT_PARTITION: "MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF",
}

SLURMDBD_CONF_TEMPLATE = """\
# Generated by tests/slurm_cluster.py.
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
LogFile={log}
PidFile={pid}
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
"""


def gres_conf(nodes: Sequence[str], gpu_files: Sequence[Path]) -> str:
    """``gres.conf``: fixed GPUs per node, no NVML autodetection."""
    lines = ["AutoDetect=off"]
    lines += [f"NodeName={n} Name=gpu File={f}" for n in nodes for f in gpu_files]
    return "\n".join(lines) + "\n"


def make_munge_key(path: Path) -> None:
    """A fresh random munge key, readable by root only."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as key:
        key.write(os.urandom(128))


def make_fake_gpu(path: Path) -> Path:
    """A character device standing in for a GPU (the numbers of /dev/null)."""
    if not path.is_char_device():
        path.unlink(missing_ok=True)
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))  # 0o020000: S_IFCHR
    return path


# --------------------------------------------------------------- network


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise SlurmClusterError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def veth_name(node: str) -> str:
    """The host end of the node's veth pair (the other end is eth0 in its netns)."""
    return f"ddp-{node}"


def setup_network(node_addrs: Mapping[str, str]) -> None:
    """A bridge for the host (10.77.0.1) and a veth-connected netns per node; hosts entries."""
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{HOST_ADDR}/{PREFIX_LEN}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    record_nodes(list(node_addrs))
    for node, addr in node_addrs.items():
        host_end = veth_name(node)
        _ip("netns", "add", node)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", node)
        _ip("link", "set", host_end, "master", BRIDGE, "up")
        _ip("-n", node, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", "eth0")
        _ip("-n", node, "link", "set", "eth0", "up")
        _ip("-n", node, "link", "set", "lo", "up")
    names = {CTLD_HOSTNAME: HOST_ADDR, **node_addrs}
    write_hosts_entries([f"{addr} {name} {HOSTS_MARKER}" for name, addr in names.items()])


def teardown_network(nodes: Sequence[str]) -> None:
    """Remove the namespaces, veths, bridge and hosts entries.

    The veths are deleted explicitly: a namespace whose last process was just
    killed is destroyed asynchronously, and its veth pair lingers until then.
    """
    for node in nodes:
        if Path(f"/run/netns/{node}").exists():
            _ip("netns", "del", node, check=False)
        if _ip("link", "show", veth_name(node), check=False).returncode == 0:
            _ip("link", "del", veth_name(node), check=False)
    if _ip("link", "show", BRIDGE, check=False).returncode == 0:
        _ip("link", "del", BRIDGE, check=False)
    write_hosts_entries([])


def write_hosts_entries(entries: Sequence[str]) -> None:
    """Replace this module's lines in /etc/hosts, in place (it may be a bind mount)."""
    kept = [line for line in HOSTS_FILE.read_text().splitlines() if HOSTS_MARKER not in line]
    text = "\n".join([*kept, *entries]) + "\n"
    with HOSTS_FILE.open("r+") as hosts:
        if hosts.read() != text:
            hosts.seek(0)
            hosts.write(text)
            hosts.truncate()


def port_listening(port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in this netns (no connection is made)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


# --------------------------------------------------------------- processes


def netns_pids(netns: str) -> list[int]:
    """Every process in a named network namespace (slurmd, slurmstepd, job tasks)."""
    if not Path(f"/run/netns/{netns}").exists():
        return []
    return [int(pid) for pid in _ip("netns", "pids", netns, check=False).stdout.split()]


def _cmdline(pid: int) -> str | None:
    """The process's NUL-separated command line; None if it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, IndexError):
        return None


def kill_pids(pids: Sequence[int], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_cmdline(p) is not None for p in pids):
            time.sleep(0.05)
        pids = [pid for pid in pids if _cmdline(pid) is not None]
        if not pids:
            return


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """Terminate our daemons all at once, then reap them (SIGKILL after ``grace``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


NODES_KEY = "_nodes"  # the state file's entry of the node names a run set up


def record_nodes(nodes: list[str]) -> None:
    """Remember the nodes (network namespaces) being set up, for a later cleanup."""
    state = _load_state()
    state[NODES_KEY] = {"names": nodes}
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state))


def _recorded_nodes() -> list[str]:
    return list(_load_state().get(NODES_KEY, {}).get("names", []))


def _load_state() -> dict[str, dict[str, int | str]]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(STATE_FILE.read_text()))
    return {}


def record_process(name: str, pid: int, program: str, marker: str) -> None:
    """Remember a daemon, so that a later run can kill it if this one crashes.

    ``program`` is the daemon's executable once the wrappers have exec'd into
    it; ``marker`` is a string in its command line (the work directory), so a
    recycled pid is never mistaken for it.
    """
    state = _load_state()
    state[name] = {"pid": pid, "program": program, "marker": marker}
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state))


def _stale_pids() -> Iterator[int]:
    """Recorded daemons that are still alive and still the same program."""
    for name, entry in _load_state().items():
        if name == NODES_KEY:
            continue
        pid = int(entry["pid"])
        cmdline = _cmdline(pid)
        if cmdline is None or pid == os.getpid():
            continue
        argv0 = Path(cmdline.split("\0", 1)[0]).name
        if argv0 == entry["program"] and str(entry["marker"]) in cmdline + _environ(pid):
            yield pid


def _environ(pid: int) -> str:
    """The process's environment block ("" if unreadable): slurmdbd's config is in it."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def check_ports_free() -> None:
    """Fail clearly when something else holds the controller's or slurmdbd's port."""
    for port in (CTLD_PORT, DBD_PORT):
        if port_listening(port):
            raise SlurmClusterError(
                f"TCP port {port} is already in use on this host (another Slurm, or an "
                f"earlier cluster this module did not record); see `ss -ltnp sport = :{port}`"
            )


def cleanup_stale_state(nodes: Sequence[str] = ()) -> None:
    """Undo what an earlier (maybe crashed) run left: processes, network, hosts entries."""
    nodes = sorted({*nodes, *NODE_ADDRS, *_recorded_nodes()})
    for node in nodes:
        kill_pids(netns_pids(node))
    kill_pids(list(_stale_pids()))
    teardown_network(nodes)
    STATE_FILE.unlink(missing_ok=True)
