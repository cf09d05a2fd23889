"""A rank's DataLoader: its workers started once and kept, every pass's batches asked of them,
and a worker that dies or stops delivering named within a bound.

Why the workers are kept: a DataLoader built per epoch (``persistent_workers=False``) forks
its workers at every epoch's and every evaluation's start, from a rank that by then runs
threads of its own (the heartbeat, gloo's, OpenMP's, TensorBoard's and MLflow's writers, a
checkpoint saved in the background). A child forked while another thread holds a lock (an
allocator's, a module import's, a file's buffer) inherits the lock held and may block on it
forever: the rank then waits for a batch that never comes. Here each :class:`Loader` forks
its workers once (:meth:`Loader.start`: the training loop calls it right after loading its
datasets, before the model, the trackers and any checkpoint thread exist) and keeps them for
the slot (``persistent_workers=True``); a pass (an epoch, an evaluation) only hands them its
requests. The alternative, workers started from a clean process (``forkserver``/``spawn``),
would pickle the dataset into every worker: a task's dataset from a task file, or holding a
lambda, would no longer load, and every pass would pay the workers' start-up again.

A request is a list of batches, each a list of sample indices and the key its random draws
are seeded from (``train.deterministic``: :func:`batch_key`), or None. The batch sampler is
in the rank (:class:`Plan`), so the workers need no state of their own: a pass's order, its
first step and its seeds are the rank's, the same at any worker count, and a run resumed
mid-epoch reads what the uninterrupted one read.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils import signal_handling

from ddppipe.core.errors import UserError
from ddppipe.data import packed, shards

Request = list[tuple[int | None, list[int]]]  # a worker's task: (seed key, indices) per batch
# The signal on which a worker writes its stack to its rank's log: the heartbeat's, which the
# hang watchdog sends to every process of a slot (ignored by default: nothing dies of it).
STACK_SIGNAL = signal.SIGWINCH
STACK_WAIT_S = 1.0  # for a signalled worker's stack to reach the log


class LoaderStalled(UserError):
    """A DataLoader worker died or delivered no batch within the rank's bound."""


def batch_key(seed: int, epoch: int, step: int, rank: int) -> int:
    """The seed of a training batch's random draws in its worker (``train.deterministic``):
    the run's seed, the epoch, the step and the rank; not the worker, nor where a slot began."""
    return (((seed * 1_000_003 + epoch) * 1_000_033 + step) * 4099 + rank) % 2**63


def read(dataset: Any, request: Request) -> list[Any]:
    """(In a worker, or the rank without any) the request's batches, collated, in order: a
    sharded dataset's samples read at once shard by shard, then decoded batch by batch; any
    other's batch by batch (a pack's stacked in one read: ``__getitems__``)."""
    if shards.is_sharded(dataset):
        samples = dataset.read([i for _, batch in request for i in batch])
        out = []
        for key, batch in request:
            _seed(key)
            out.append(default_collate([dataset.decode(samples[i]) for i in batch]))
        return out
    getitems = getattr(dataset, "__getitems__", None)
    out = []
    for key, batch in request:
        _seed(key)
        data = getitems(batch) if getitems else [dataset[i] for i in batch]
        out.append(packed.as_batch(data) if packed.is_packed(dataset) else default_collate(data))
    return out


def _seed(key: int | None) -> None:
    """torch's, ``random``'s and NumPy's draws of this process from ``key`` (None: as they are)."""
    if key is None:
        return
    torch.manual_seed(key)
    random.seed(key)
    numpy.random.seed(key % 2**32)


class _Reader(Dataset):
    """What a worker holds: the dataset, asked a whole request at once."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, request: Request) -> list[Any]:
        return read(self.dataset, request)


class Plan:
    """The loader's batch sampler: the requests of the pass under way (set before each)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)


def _as_fetched(fetched: Any) -> Any:
    """The loader's ``collate_fn``: a request comes back as its list of collated batches."""
    return fetched


def _in_worker(worker_id: int) -> None:
    """(In a worker, once) its stack to its rank's log on :data:`STACK_SIGNAL`."""
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


class Loader:
    """One dataset's DataLoader for a slot: ``workers`` processes (none: read in the rank),
    started once and kept; ``wait_bound(longest)``: the seconds the rank waits for a batch,
    from the longest wait seen so far (None before one), or no bound when not given."""

    def __init__(self, dataset: Any, workers: int, pin_memory: bool, prefetch: int,
                 wait_bound: Callable[[float | None], float] | None = None) -> None:  # fmt: skip
        self.dataset, self.workers, self.wait_bound = dataset, workers, wait_bound
        self.plan = Plan()
        self.longest_wait_s: float | None = None
        self._pass = 0  # the pass under way: a second one started ends the first
        self._watching, self._fetching = False, False
        self._died: RuntimeError | None = None  # torch's error of a worker that died
        kwargs: dict[str, Any] = {}
        if workers:
            kwargs = {"persistent_workers": True, "prefetch_factor": prefetch,
                      "worker_init_fn": _in_worker, "timeout": self._bound()}  # fmt: skip
        self.loader = DataLoader(
            _Reader(dataset), batch_sampler=self.plan, num_workers=workers,
            collate_fn=_as_fetched, pin_memory=pin_memory, **kwargs,
        )  # fmt: skip

    def _bound(self) -> float:
        return self.wait_bound(self.longest_wait_s) if self.wait_bound is not None else 0.0

    def start(self) -> None:
        """Fork the workers now (an empty pass), not at the first pass's start."""
        if self.workers:
            self.plan.requests = []
            for _ in self._iterator("the loader's start"):
                pass

    def batches(self, requests: Sequence[Request], what: str) -> Iterator[Any]:
        """Every batch of ``requests``, in order; ``what`` (``rank 1, train epoch 3``) names
        the pass in the error of a worker that dies or stalls (:class:`LoaderStalled`)."""
        self._pass += 1
        mine = self._pass
        self.plan.requests = list(requests)
        if not self.workers:
            for request in self.plan.requests:
                yield from read(self.dataset, request)
            return
        it = self._iterator(what)
        while True:
            if self._pass != mine:
                raise RuntimeError(f"{what}: another pass of the same loader began meanwhile")
            if self._died is not None:  # a worker died between two fetches
                raise self._stalled(it, what, self._died) from self._died
            started = time.perf_counter()
            try:
                self._fetching = True
                with _alarm(self.loader.timeout):
                    fetched = next(it)
            except StopIteration:
                return
            except (RuntimeError, OSError, EOFError, _Late) as e:
                raise self._stalled(it, what, e) from e
            finally:
                self._fetching = False
            waited = time.perf_counter() - started
            if self.longest_wait_s is None or waited > self.longest_wait_s:
                self.longest_wait_s = waited
                self.loader.timeout = it._timeout = self._bound()  # (read at every wait)
            yield from fetched

    def _iterator(self, what: str) -> Any:
        self.loader.timeout = self._bound()  # (a new iterator's; a kept one's is set below)
        if self._died is not None:  # a worker died since the last pass
            raise self._stalled(self.loader._iterator, what, self._died) from self._died
        try:
            self._fetching = True
            with _alarm(self.loader.timeout):
                it = iter(self.loader)  # a kept iterator: the workers resume, then prefetch
        except (RuntimeError, OSError, EOFError, _Late) as e:
            raise self._stalled(self.loader._iterator, what, e) from e
        finally:
            self._fetching = False
        it._timeout = self.loader.timeout
        if not self._watching and threading.current_thread() is threading.main_thread():
            self._watching = True
            self._name_a_killed_worker()
        return it

    def _name_a_killed_worker(self) -> None:
        """torch's SIGCHLD handler (set by the first iterator) raises its RuntimeError where
        the rank is when a worker dies, a training step or a failure's record included: a
        death of one of this loader's workers is raised only inside a fetch, else at the next
        one (:meth:`batches`), as :class:`LoaderStalled`."""
        previous = signal.getsignal(signal.SIGCHLD)

        def on_child(signum: int, frame: Any) -> None:
            try:
                if callable(previous):
                    previous(signum, frame)
            except RuntimeError as e:
                it = self.loader._iterator
                if it is None or not any(
                    _state(w.pid) in ("Z", "X", "gone") for w in getattr(it, "_workers", [])
                ):
                    raise  # (another loader's worker)
                self._died = e
                if self._fetching:
                    raise

        signal.signal(signal.SIGCHLD, on_child)

    def _stalled(self, it: Any, what: str, error: Exception) -> Exception:
        """The error naming the worker that died or owes the next batch, and what to do."""
        text = str(error)
        if text.startswith("Caught "):  # the dataset's own, raised in a worker
            return error
        workers = list(getattr(it, "_workers", []))
        states = [_state(proc.pid) for proc in workers]
        ended = {"Z", "X", "gone"}
        if isinstance(error, OSError | EOFError):  # the worker it came from may be exiting
            deadline = time.monotonic() + STACK_WAIT_S
            while not ended & set(states) and time.monotonic() < deadline:
                time.sleep(0.05)
                states = [_state(proc.pid) for proc in workers]
        if isinstance(error, _Late):
            text = f"DataLoader timed out after {self.loader.timeout:.0f} seconds"
        elif isinstance(error, OSError | EOFError) and ended & set(states):
            # a batch's memory asked of a worker that died meanwhile
            text = f"{type(error).__name__}: {text}, receiving a batch of a worker that ended"
        elif not text.startswith(("DataLoader timed out", "DataLoader worker (pid")):
            return error  # (the dataset's own, raised in a worker: "Caught ... in DataLoader")
        owed = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", None), ())
        # a worker that ended, else one stopped or waiting for I/O, else the one owing the
        # next batch (a worker stopped after sending a batch blocks its receipt: its memory
        # is handed over by the worker), else every worker
        dead = [w for w, state in enumerate(states) if state in ended]
        odd = [w for w, state in enumerate(states) if state in ("T", "t", "D")]
        suspects = dead or odd or ([owed[0]] if len(owed) == 1 else range(len(workers)))
        for proc, state in zip(workers, states, strict=True):
            if state not in ended | {"T", "t"}:  # (a stopped one cannot write its stack)
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, STACK_SIGNAL)  # every live worker's stack to the log
        if "timed out" in text:
            time.sleep(STACK_WAIT_S)
        who = ", ".join(
            f"worker {w} (pid {workers[w].pid}, "
            f"{_ended(workers[w]) or _STATES.get(states[w], states[w])})"
            for w in suspects
        )
        # The workers ended: the rank's exit joins its children, and a stopped one ends on
        # SIGKILL only (torch's SIGCHLD check told first, as its own shutdown does: it would
        # raise its own error in place of this one).
        if getattr(it, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for proc in workers:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        return LoaderStalled(
            f"{what}: DataLoader {who or 'worker'} delivered no batch ({text}; the rank's bound "
            "on a wait for a batch follows launch.hang_timeout_s: docs/training.md). The "
            "workers' stacks, where they could write them, are in this log above. A worker "
            "stopped (T) was stopped by a signal; one in D waits for the filesystem (copy the "
            "data to node-local disk: launch.stage_data); one killed may have run out of "
            "memory (fewer launch.loader_workers). The slot ends; a restart continues from the "
            "last checkpoint"
        )


class _Late(Exception):
    """(Raised by :func:`_alarm`) A batch not fetched within the rank's bound."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """:class:`_Late` raised in the rank's main thread after ``seconds`` (0: never): a fetch
    can block outside the DataLoader's own timeout, e.g. receiving a batch's shared memory
    from a worker stopped after it sent the batch (the worker hands its file descriptor over).
    Elsewhere than the main thread, the DataLoader's own timeout alone."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def late(signum: int, frame: Any) -> None:
        raise _Late

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_STATES = {"R": "running", "S": "sleeping", "D": "in D: waiting for I/O",
           "T": "stopped (T)", "t": "stopped by a debugger", "Z": "exited",
           "gone": "gone"}  # fmt: skip


def _ended(proc: Any) -> str | None:
    """How a worker process ended (None: it has not, or it is not known)."""
    code = proc.exitcode
    if code is None and _state(proc.pid) in ("Z", "X"):  # exiting: its status in a moment
        proc.join(STACK_WAIT_S)
        code = proc.exitcode
    if code is None:
        return None
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _state(pid: int) -> str:
    """The kernel's one-letter state of process ``pid``, or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
