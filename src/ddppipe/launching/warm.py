"""Warm ranks: a server that imported torch once forks each training process of later slots.

A rank started cold pays for its interpreter, ``import torch`` (~1.5 s, seconds more when
several start together) and DDP's own imports before its first step; a sweep paid that for
every trial. The server (``ddppipe warm-server``) imports them once and forks a rank per
request: the rank starts in milliseconds, with nothing of another trial in it (a fresh process
per rank: its memory, threads and devices are its own). The server runs no torch operation and
never touches CUDA, so forking it is safe (should a task's datasets, which it loads and keeps
for the ranks, touch CUDA, it forks no rank after: each starts cold, its launcher saying
why); it ignores the stop signals, so a rank forked from it never dies of one before its own
handler is in place.

A launcher uses it (:mod:`ddppipe.launching.warm_client`) when ``DDPPIPE_WARM_SOCKET``
(:mod:`ddppipe.core.env_names`) names a live server on this machine and the rank's command is
``python -m MODULE ...`` of the server's own interpreter, MODULE one of :data:`SERVED` (never
inside a container: the image's Python is another). Each request is one connection: the
command, environment, working folder, CPUs and the launcher's stdin/stdout/stderr (passed as
file descriptors) go in; the rank's pid comes back, then its exit status. A launcher that dies
closes the connection, and the server kills its ranks.

Only its own user can use it (docs/security.md): the socket is 0600 in a folder only the user
can enter (:func:`private_folder`), every connection's peer is checked (``SO_PEERCRED``: the
server's uid, else refused and logged), and a request may name only :data:`SERVED`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ddppipe.core import env_names, private
from ddppipe.core.errors import UserError
from ddppipe.launching import warm_reaper, warm_sources

log = logging.getLogger(__name__)

# What a request may run: a launcher's rank entry points (a task's ``ddppipe train``, a script's
# runner) and ddppipe's own subcommands (warm_client.delegate); nothing else is forked.
SERVED = frozenset({"ddppipe", "ddppipe.training.script.run_script"})
FOLDER_PREFIX = "ddppipe-warm-"  # a private folder made for a socket (mkdtemp), removed after
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_DEFAULT_THREADS = 1  # torch's own thread count in the server before it set 1
# ``ahead`` is imported once no request came for this long: callers that waited for the server
# (polling every 50 ms) are forked first; one that comes during the imports waits for them.
_SETTLE_S = 0.2
# A local call's server is kept this long after its call ended, for the next call of the same
# project (its imports done: its ranks start at once); one kept server a user, the newest.
KEEP_S = 600.0
# An idle kept server gives way to a newer one of its user's after this share of its keep time
# (30 s): the next call of its own folder, a moment later, still finds it.
_YIELD_SHARE = 0.05
# How often an idle kept server wakes (a connection wakes it at once): not 20 times a second for
# 10 minutes, which keeps a laptop's CPU from its deep sleep states.
_IDLE_POLL_S = 1.0
_ADOPT_TIMEOUT_S = 10.0  # a kept server answers at once: one that does not is replaced
KEPT_PREFIX = "ddppipe-warm-kept-"  # a kept server's socket: KEPT_PREFIX + its key + ".sock"


# -- the server ------------------------------------------------------------------------------


def serve(path: Path, preload: Callable[[], Sequence[ModuleType]],
          data: list[dict[str, Any]] | None = None,
          ahead: Callable[[], Sequence[ModuleType]] | None = None,
          later: Callable[[], Sequence[ModuleType]] | None = None,
          keep_s: float = 0.0, caller: int | None = None) -> None:  # fmt: skip
    """Import what the first requests need (``preload``: torch), listen on the Unix socket
    ``path``, and fork a process for each request until SIGTERM, or until its first
    ``caller`` (the pid of the call that started it; default: its parent) and every call that
    adopted it (:func:`kept`) have ended: then at once
    (``keep_s`` 0), else once none of its ranks runs and no call adopted it for ``keep_s``
    seconds (a twentieth of it when a newer kept server of this user's is in its folder: one
    kept per user), or when a caller finds it stale (a source it imported changed:
    :mod:`.warm_sources`). :mod:`ddppipe.cli.warm_server` names the imports. While no
    request waits, in this order: ``ahead``, the rest of what a rank imports before its first
    step (every training rank is forked after it: one that asks first waits for it);
    ``data``, the task datasets to load and keep for the ranks (``task``, ``data_dir``,
    ``args`` each), each once its data is prepared; ``later``, what the commands after a
    training import (plots), once a training's rank is forked (beside the training, not on its
    way to its first step)."""
    started = time.monotonic()
    _check_private(path.parent)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # inherited until a rank installs its own handler
    callers = [_watch(os.getppid() if caller is None else caller)]  # each ends with its process
    preloaded = ", ".join(m.__name__ for m in preload())
    sources = warm_sources.snapshot({})
    global _DEFAULT_THREADS
    if "torch" in sys.modules:  # no thread pool in a process that forks (each rank sets its own)
        _DEFAULT_THREADS = sys.modules["torch"].get_num_threads()
        sys.modules["torch"].set_num_threads(1)
    _check_no_cuda()
    cuda_at_start = cuda_state()
    cold: str | None = None  # why every rank starts cold (the server touched CUDA)
    pending = list(data or [])
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    def import_ahead() -> None:
        """``ahead`` imported (once), before the first training rank is forked."""
        nonlocal ahead, cuda_at_start, sources
        if ahead is not None:
            with warm_reaper.reaping(ranks):
                names = ", ".join(m.__name__ for m in ahead())
            ahead = None
            sources = warm_sources.snapshot(sources)
            _check_no_cuda()
            cuda_at_start = cuda_state()  # (what the imports mapped is no task's doing)
            log.info("warm ranks ready in %.1f s (%s)", time.monotonic() - started, names)

    def adopted(request: dict[str, Any], peer: int) -> dict[str, Any]:
        """A later call's (``request["adopt"]``: its pid) use of this kept server, unless a
        source it imported changed: then it is stale, listens no more, and ends once idle."""
        nonlocal listener
        if (why := warm_sources.changed(sources)) is not None:
            log.info("warm server stale: %s changed since it was imported; the call of pid %d "
                     "starts a fresh one", why, peer)  # fmt: skip
            listener.close()
            _remove(path)
            listener = None
            return {"stale": f"{why} changed since the server imported it"}
        pidfd = _watch(int(request["adopt"]))
        if pidfd is not None:
            callers.append(pidfd)
        pending.extend(d for d in request.get("data", []) if d not in pending)
        os.utime(path)  # the newest kept server now: an older idle one ends
        log.info("warm server adopted by the call of pid %d (%s)", peer, _since(started))
        return {"adopted": os.getpid()}

    signal.signal(signal.SIGTERM, on_term)
    listener: socket.socket | None = _listen(path)
    log.info("warm server listening after %.1f s (%s)", time.monotonic() - started, preloaded)
    last_request = time.monotonic()
    idle_since: float | None = None
    ranks: dict[int, socket.socket] = {}  # pid -> its launcher's connection
    orphans: set[int] = set()  # ranks whose launcher went away, killed
    trains = False  # a training's rank was forked
    try:
        while not stop:
            callers = [c for c in callers if c is not None and not _ended(c)]
            if callers or (ranks and keep_s):
                idle_since = None
            elif not keep_s or listener is None:
                break  # its callers gone (a stale server: its last rank too)
            else:
                if idle_since is None:  # its last call ended: it keeps its imports, not data
                    idle_since = time.monotonic()
                    pending = []
                    _drop_data()
                idle = time.monotonic() - idle_since
                if idle >= keep_s or (idle >= keep_s * _YIELD_SHARE and _newer_kept(path)):
                    log.info("warm server idle for %.0f s since its last call: ending", idle)
                    break
            watched = [c for p, c in ranks.items() if p not in orphans]
            listening = [listener] if listener is not None else []
            wait = warm_reaper.POLL_S if idle_since is None else _IDLE_POLL_S
            readable, _, _ = select.select([*listening, *watched], [], [], wait)
            for conn in readable:
                if conn is listener:
                    trains = _accept(conn, ranks, cold, import_ahead, adopted) or trains
                    last_request = time.monotonic()
                else:  # a launcher closed its connection (it died): end its rank
                    pid = next(p for p, c in ranks.items() if c is conn)
                    orphans.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            warm_reaper.reap(ranks)
            orphans &= ranks.keys()
            if ahead is not None and not readable:
                if time.monotonic() - last_request >= _SETTLE_S:
                    import_ahead()
            elif pending and not readable:
                with warm_reaper.reaping(ranks):
                    pending, loaded = _keep_data(pending)
                sources = warm_sources.snapshot(sources)  # (a task's own modules)
                if loaded is not None and cold is None and cuda_touched(cuda_at_start):
                    cold = (f"loading the datasets of {loaded.get('task')} touched CUDA (pinned "
                            "memory, or torch.cuda asked): a rank forked from it could not "
                            "use CUDA")  # fmt: skip
                    log.warning("warm server: %s; every rank starts cold", cold)
            elif later is not None and trains and not readable:
                with warm_reaper.reaping(ranks):
                    log.info("imported for later commands: %s",
                             ", ".join(m.__name__ for m in later()))  # fmt: skip
                later = None
                sources = warm_sources.snapshot(sources)
    finally:
        if listener is not None:
            listener.close()
            _remove(path)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _drop_data() -> None:
    """The kept datasets forgotten: a server kept between calls holds its imports only (a
    call that adopts it asks for its datasets again, loaded while its first jobs run)."""
    kept = sys.modules.get("ddppipe.tasks.kept_datasets")
    if kept is not None and (dropped := kept.drop()):
        log.info("warm server idle: %d kept dataset(s) freed", dropped)


def _since(started: float) -> str:
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    return f"started {minutes} min {seconds} s ago"


def _watch(pid: int) -> int | None:
    """A file descriptor that tells when process ``pid`` ends (None: it has ended)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _ended(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` (:func:`_watch`) ended (its descriptor then closed)."""
    if not select.select([pidfd], [], [], 0)[0]:
        return False
    os.close(pidfd)
    return True


def _newer_kept(path: Path) -> bool:
    """Whether another kept server of this user's was started or adopted after this one
    (:func:`kept_socket`: its socket's time is newer)."""
    try:
        mine = path.stat().st_mtime_ns
        return any(other != path and other.stat().st_mtime_ns > mine
                   for other in path.parent.glob(f"{KEPT_PREFIX}*.sock"))  # fmt: skip
    except OSError:  # (this one's socket gone: another server took its name)
        return True


def _keep_data(
    pending: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Load the first of ``pending``'s datasets whose data is prepared: the rest, and the one
    whose task's code ran (kept, or failed to load; None: no data prepared yet)."""
    from ddppipe import tasks
    from ddppipe.tasks import kept_datasets

    for k, item in enumerate(pending):
        try:
            task = tasks.load(item["task"], step="warm-server")
            if kept_datasets.keep(task, Path(item["data_dir"]), item["args"]):
                log.info("kept the datasets of %s (%s) for the ranks", item["task"],
                         item["data_dir"])  # fmt: skip
                return pending[:k] + pending[k + 1 :], item
        except Exception as e:  # a task that cannot load here: its ranks load their own
            log.warning("not keeping the datasets of %s: %s", item.get("task"), e)
            return pending[:k] + pending[k + 1 :], item
    return pending, None


def _check_no_cuda() -> None:
    """A forked rank could not use CUDA had the server touched it: refuse to serve then."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the warm server initialized CUDA: its forked ranks could not use it")


def _driver_loaded() -> bool:
    """Whether the CUDA driver's library is mapped into this process (it is once anything
    initialized the driver: ``torch.cuda.is_available()``, pinned memory)."""
    try:
        return "/libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _nvidia_files() -> int:
    """How many NVIDIA device files this process has open: the control device once the driver
    is initialized, a GPU's and nvidia-uvm's once a CUDA context exists (pinned memory makes
    one without ``torch.cuda`` knowing: seen on an H200, where the driver's library was mapped
    before serving already)."""
    count = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
    return count


def cuda_state() -> tuple[bool, int]:
    """What this process holds of CUDA: the driver's library mapped, its device files open."""
    return _driver_loaded(), _nvidia_files()


def cuda_touched(at_start: tuple[bool, int]) -> bool:
    """Whether this process touched CUDA since it started serving (``at_start``: its
    :func:`cuda_state` then, after the imports): torch initialized it, the driver's library
    came in (``torch.cuda.is_initialized()`` stays False when a task's code asked the driver
    directly), or an NVIDIA device file was opened (a context made by pinned memory)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    driver, files = cuda_state()
    return (driver and not at_start[0]) or files > at_start[1]


def _remove(path: Path) -> None:
    """The socket ``path`` gone, and its folder when it was made for it (:func:`private_folder`)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    if path.parent.name.startswith(FOLDER_PREFIX):
        with contextlib.suppress(OSError):  # (not empty: another server's socket is there)
            path.parent.rmdir()


def _runtime_folder() -> Path | None:
    """``XDG_RUNTIME_DIR`` where it is set and private (mode 0700, this user's); else None."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) if runtime and private.problem(Path(runtime)) is None else None


def private_folder() -> Path:
    """A folder for a server's socket that only this user can enter: :func:`_runtime_folder`,
    else a new one in the temporary folder."""
    return _runtime_folder() or Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))  # mode 0700


def _check_private(folder: Path) -> None:
    """Refuse a socket folder another user may enter (they could reach the socket)."""
    if why := private.problem(folder):
        raise UserError(
            f"the warm server's socket folder is not private ({why}): other users could reach "
            "the socket; give a folder of yours with mode 0700 "
            "(ddppipe.launching.warm.private_folder makes one)"
        )


def _listen(path: Path) -> socket.socket:
    """The server's socket (mode 0600), bound under a temporary name and renamed: a launcher
    that finds ``path`` finds a server that listens."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is 0600 from its creation, whatever the caller's umask
    try:
        listener.bind(str(tmp))
    finally:
        os.umask(umask)
    listener.listen(64)
    os.replace(tmp, path)
    return listener


def peer_uid(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of the Unix socket ``conn``."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))  # fmt: skip
    return pid, uid


def refusal(request: Any) -> str | None:
    """Why ``request`` is not served (None: it is): anything but a rank entry point or a
    ddppipe subcommand (:data:`SERVED`), or a request of another shape."""
    if not isinstance(request, dict):
        return "a request is a JSON object"
    module, args, env = request.get("module"), request.get("args"), request.get("env")
    if module not in SERVED:
        return f"module {module!r} is none of {', '.join(sorted(SERVED))}"
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        return "args is not a list of strings"
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        return "env is not a mapping of strings"
    if not isinstance(request.get("cwd"), str):
        return "cwd is not a path"
    return None


def _accept(listener: socket.socket, ranks: dict[int, socket.socket], cold: str | None,
            before_rank: Callable[[], None],
            adopt: Callable[[dict[str, Any], int], dict[str, Any]]) -> bool:  # fmt: skip
    """Fork the rank a connection asks for (a training's rank after ``before_rank()``), or
    refuse it (another user's, a request of another kind, or ``cold``: why no rank may be
    forked now, the launcher starts it), or answer a later call's adoption (``adopt``);
    whether it forked a training's rank (not a ddppipe command delegated to it)."""
    conn, _ = listener.accept()
    peer, uid = peer_uid(conn)
    if uid != os.getuid():  # before reading a byte of it
        log.warning("warm server: refused a connection of uid %d (pid %d): it serves uid %d only",
                    uid, peer, os.getuid())  # fmt: skip
        conn.close()
        return False
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        adopting = isinstance(request, dict) and isinstance(request.get("adopt"), int)
        refused = None if adopting else refusal(request)
    except (OSError, ValueError) as e:
        adopting, refused = False, f"a bad request ({e})"
    if adopting:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(adopt(request, peer)).encode() + b"\n")
        conn.close()
        return False
    refused = refused or cold
    if refused is not None:
        log.warning("warm server: refused a request of pid %d: %s", peer, refused)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"refused": refused}).encode() + b"\n")
        conn.close()
        return False
    training = not request["env"].get(env_names.WARM_CHILD)
    if training:
        before_rank()
    pid = os.fork()
    if pid == 0:  # the rank
        listener.close()
        for c in ranks.values():
            c.close()
        conn.close()
        _become_rank(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    ranks[pid] = conn
    return training


def _die_with_server() -> None:
    """(In a forked rank) SIGKILL when the server dies: its launcher hears so from it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _new_paths(server: str, caller: str) -> list[str]:
    """The entries of the caller's PYTHONPATH the server's lacks, in order."""
    have = set(server.split(os.pathsep))
    return [p for p in caller.split(os.pathsep) if p and p not in have]


def _become_rank(request: dict[str, Any], fds: list[int]) -> None:
    """(In the forked child) Run ``python -m MODULE ARGS`` as the launcher asked, then exit."""
    code = 1
    try:
        os.setsid()
        _die_with_server()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        added = _new_paths(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
        # as `python -m` of the caller would: its folder first (the server's was), then its
        # PYTHONPATH (a script's runner replaces the first entry by the script's folder)
        sys.path[:1] = [os.getcwd(), *added]
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cpus"):
            os.sched_setaffinity(0, request["cpus"])
        with contextlib.suppress(PermissionError):  # (a lower niceness than the server's)
            os.setpriority(os.PRIO_PROCESS, 0, request.get("nice", 0))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for handler in logging.root.handlers[:]:  # the command sets up its own (its rank's)
            logging.root.removeHandler(handler)
        threads = request["env"].get("OMP_NUM_THREADS")
        if "torch" in sys.modules:  # torch read it when the server imported it
            count = int(threads) if threads and threads.isdigit() else _DEFAULT_THREADS
            sys.modules["torch"].set_num_threads(max(1, count))  # 0: a `threads: 0` rule
        module, args = request["module"], request["args"]
        sys.argv = [module, *args]
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# -- starting the server ---------------------------------------------------------------------


def local_socket(name: str | None = None) -> Path:
    """A socket path ``name`` (default: one of this process) in a :func:`private_folder` (short:
    a Unix socket's path is at most 107 bytes, so not under a deep work folder)."""
    return private_folder() / (name or f"ddppipe-warm-{os.getpid()}.sock")


def start(path: Path, log_path: Path, data: list[dict[str, Any]] | None = None,
          keep_s: float = 0.0) -> subprocess.Popen:  # fmt: skip
    """Start a server on ``path`` (its log in ``log_path``; ``data``: the datasets to keep,
    ``keep_s``: how long it outlives its callers, see :func:`serve`); it listens seconds
    later (:func:`ddppipe.launching.warm_client.usable` waits for it)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "ddppipe", "warm-server", "--socket", str(path),
             "--data-json", json.dumps(data or []), "--keep-s", str(keep_s),
             "--caller", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, start_new_session=True,
        )  # fmt: skip
    return server


# What a server's imports read from the environment (torch's settings, the libraries it loads,
# Python's): a call whose values differ gets a server of its own.
_IMPORT_ENV = ("TORCH", "PYTORCH", "LD_", "PYTHON", "OMP_", "MKL_", "KMP_")


def kept_socket(project: Path) -> Path:
    """The socket of the server kept for the calls of ``project`` (a Snakemake working
    folder) with this interpreter and import environment, in this user's private folder."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_IMPORT_ENV)}
    key = json.dumps([str(project.resolve()), sys.executable, env])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = _runtime_folder() or private.user_folder(Path(tempfile.gettempdir()))
    return folder / f"{KEPT_PREFIX}{digest}.sock"


def kept(project: Path, log_path: Path, data: list[dict[str, Any]]) -> tuple[Path, int]:
    """The warm server of this call of ``project``: the one kept since an earlier call,
    adopted (asked to keep ``data`` too), where it listens and its imports are unchanged;
    else a new one, kept :data:`KEEP_S` seconds after this call. Its socket and pid."""
    path = kept_socket(project)
    pid = _adopt(path, data)
    if pid is None:
        pid = start(path, log_path, data, KEEP_S).pid
    return path, pid


def _adopt(path: Path, data: list[dict[str, Any]]) -> int | None:
    """The pid of the kept server on ``path``, now serving this process too; None when none
    listens there or it is stale (its log says why)."""
    if not path.is_socket():
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_ADOPT_TIMEOUT_S)
            conn.connect(str(path))
            conn.sendall(json.dumps({"adopt": os.getpid(), "data": data}).encode())
            answer = json.loads(conn.makefile("rb").readline() or b"{}")
    except (OSError, ValueError) as e:
        log.info("kept warm server on %s unusable (%s): starting another", path, e)
        return None
    if "stale" in answer:
        log.info("kept warm server stale (%s): starting another", answer["stale"])
    pid = answer.get("adopted")
    return pid if isinstance(pid, int) else None
