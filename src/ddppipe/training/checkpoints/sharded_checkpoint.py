"""Sharded checkpoints (``torch.distributed.checkpoint``): every rank writes its part in the
background while training goes on; a checkpoint counts only once all of it is written.

A checkpoint is a folder ``ckpt-eEEEE-sSSSSSS/`` holding DCP's files (``.metadata`` and the
writing ranks' ``*.distcp``: weights and optimizer state, sharded or not), each rank's RNG
streams in a file of its own (``rng-<rank>.pt``: written by that rank, read back by it alone;
never gathered), ``state.pt`` (what is not a tensor: epoch, step, scheduler, how many ranks
saved streams, history, meta, config hash) and the marker ``COMMITTED``. It is written as
``ckpt-….saving/``; when rank 0's save has completed (DCP's metadata is written after every
writing rank reported its part written) and every rank said its streams are written, rank 0
writes ``state.pt`` (serialized when the save began), the marker, and renames the folder into
place. So a process killed during a save leaves a ``.saving`` folder, never a checkpoint that
is picked; the next save or resume removes it. Being written in parts, a checkpoint loads at
any world size and either strategy.

Where every rank holds the same tensors (DDP: ``replicated``), rank 0 alone copies and writes
them (DCP without collectives), and a resume has rank 0 alone read them and broadcast them:
the state is held in host memory, written and read once a job, not once a rank. Sharded
tensors (FSDP2) are written and read by every rank, each its own part.

Before its write, a save copies its tensors into CPU memory (DCP's staging): on the training
thread (DCP's stager: FSDP's shards), or, given a
:class:`~ddppipe.training.checkpoints.background_copy.BackgroundCopy` (DDP), by a worker
thread while training goes on. Each save reports what it cost: the copy's seconds and the
write's (from the copy's end to the commit), :class:`Written`.

Runs started before sharded checkpoints have ``ckpt-*.pt`` files
(:mod:`ddppipe.training.checkpoints.checkpoint`): they are read too (a DDP run resumes from
them) and counted among the ``keep`` newest. The other guarantees are those of the file
store: damaged checkpoints go to ``damaged/``, another config's to ``stale-<hash>/``, nothing
else is deleted but leftovers of killed saves and checkpoints beyond ``keep``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddppipe.core import atomic
from ddppipe.training.checkpoints import background_copy, checkpoint, store_files

log = logging.getLogger(__name__)

FORMAT = 2
SAVING = ".saving"  # suffix of a folder being written
COMMITTED = "COMMITTED"  # the marker of a complete checkpoint
STATE = "state.pt"  # its non-tensor state
STREAMS = "rng-{rank}.pt"  # a rank's RNG streams
REQUIRED_KEYS = frozenset(checkpoint.REQUIRED_KEYS - {"model", "optimizer"})


def _failed_types() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return (Exception, CheckpointException)


_FAILED = _failed_types()


def folder_name(epoch: int, step: int) -> str:
    """``epoch`` completed epochs plus ``step`` steps into the next one."""
    return store_files.stem(epoch, step)


def write_streams(folder: Path, rank: int, streams: Any) -> str | None:
    """Write rank ``rank``'s RNG ``streams`` into the checkpoint folder being saved (one file,
    made durable; the folder's rename makes it part of a checkpoint); the rank's message if it
    could not."""
    path = folder / STREAMS.format(rank=rank)
    try:
        with open(path, "wb") as f:
            f.write(checkpoint.serialized(streams))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        named = e if e.filename is not None else OSError(e.errno, e.strerror, str(path))
        return store_files.write_failure(named, rank)
    return None


def read_streams(path: Path, rank: int) -> Any:
    """Rank ``rank``'s RNG streams in checkpoint ``path``; None where they cannot be read."""
    file = path / STREAMS.format(rank=rank)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        log.warning("%s unreadable (%s: %s): rank %d's dropout stream is reseeded", file,
                    type(e).__name__, e, rank)  # fmt: skip
        return None


@dataclass
class Found:
    """The checkpoint to resume from: its path and its non-tensor state (the whole snapshot
    for a ``ckpt-*.pt`` file of a run started before sharded checkpoints)."""

    path: Path
    state: dict[str, Any]

    @property
    def legacy(self) -> bool:
        return self.path.suffix == ".pt"


@dataclass(frozen=True)
class Written:
    """A committed save (rank 0's): its folder, its seconds from start to commit, its copy's
    seconds (into CPU memory) and its write's (from the copy's end to the commit)."""

    path: Path
    seconds: float
    copy_s: float
    write_s: float


@dataclass
class _Pending:
    """A save in flight."""

    name: str
    started: float
    future: Any  # concurrent.futures.Future of dcp.async_save's write (done: none here)
    copied: tuple[float, float] | None  # the copy's start and end; None: the copier's times
    state: bytes  # rank 0's non-tensor state, serialized at the save (written by the commit)
    failed: str | None  # this rank's streams not written: why
    others_failed: bool  # (rank 0) another rank's streams not written: no commit
    committer: threading.Thread | None = None  # rank 0's
    outcome: dict[str, Any] = field(default_factory=dict)  # rank 0's: Written, or error


class Store:
    """The sharded checkpoints of one run, in one folder.

    ``group``: the process group DCP's background collectives use. Give it a group of its own
    (``dist.new_group(backend="gloo")``): the save's collectives run in a thread, and sharing the
    training's group with them can deadlock against the training's own collectives.
    ``copier``: the saves' tensors copied off the training thread (else on it, by DCP).
    ``replicated``: every rank holds the same tensors (DDP): rank 0 alone copies, writes and
    reads them (the others' copier unused: give them none).
    """

    def __init__(self, folder: Path, keep: int = 2, group: Any = None,
                 copier: background_copy.BackgroundCopy | None = None,
                 replicated: bool = False) -> None:  # fmt: skip
        self.folder, self.keep, self.group, self.copier = Path(folder), keep, group, copier
        self.replicated = replicated
        self._pending: _Pending | None = None
        self._staging: Any = None  # DCP's stager, created at the first save

    # -- what is there (any process) ------------------------------------------------------
    def paths(self) -> list[Path]:
        """Committed checkpoint folders and ``ckpt-*.pt`` files, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [p for p in self.folder.iterdir()
                 if (store_files.FOLDER_PATTERN.match(p.name) and (p / COMMITTED).is_file())
                 or store_files.FILE_PATTERN.match(p.name)]  # fmt: skip
        return sorted(found, key=lambda p: (p.name.removesuffix(".pt"), p.suffix != ".pt"))

    def latest(self, config_hash: str) -> Found | None:
        """(Rank 0) The newest readable checkpoint of this config, falling back past damaged
        ones (moved to ``damaged/``); another config's move to ``stale-<hash>/`` (start over)."""
        self._remove_leftovers()

        def read(path: Path) -> dict[str, Any]:
            return checkpoint.load(path) if path.suffix == ".pt" else read_state(path)

        found = store_files.newest(
            self.folder, self.paths(), config_hash, read, checkpoint.CheckpointError
        )
        return Found(*found) if found else None

    def _remove_leftovers(self) -> None:
        """Remove what killed saves left: ``.saving`` folders and the file store's temp files;
        a checkpoint folder without its marker (never written by this store) is damaged."""
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            if path.is_dir() and store_files.FOLDER_PATTERN.match(path.name.removesuffix(SAVING)):
                if path.name.endswith(SAVING):
                    shutil.rmtree(path, ignore_errors=True)
                    log.warning("removed %s, left by an interrupted checkpoint save", path)
                elif not (path / COMMITTED).is_file():
                    moved = store_files.move_into(path, self.folder / "damaged")
                    log.warning("%s has no %s marker: moved to %s", path, COMMITTED, moved)
            else:
                store_files.remove_if_temporary(path)

    # -- saving (collective) --------------------------------------------------------------
    @property
    def writes_tensors(self) -> bool:
        """Whether this rank writes tensors (rank 0 alone where they are ``replicated``)."""
        return not self.replicated or dist.get_rank() == 0

    def save(self, state: dict[str, Any], tensors: dict[str, Any], streams: Any) -> str:
        """Collective: start writing a checkpoint of ``state`` (non-tensor, complete on rank 0),
        ``tensors`` (every rank's: its state dicts of model and optimizer; only rank 0's where
        ``replicated``) and this rank's RNG ``streams`` (written now, to a file of its own);
        returns its name at once, its tensors' copy still being taken where there is a
        ``copier``. Waits for a previous save first (one in flight at a time)."""
        self.wait()
        name = folder_name(state["epoch"], state["step"])
        started = time.perf_counter()
        saving = self.folder / (name + SAVING)

        def prepare() -> None:
            self._remove_leftovers()
            saving.mkdir(parents=True)

        checkpoint.rank0_writes(prepare)  # every rank waits for the folder (and its outcome)
        rank = dist.get_rank()
        main = rank == 0  # (its state is complete; written with the commit)
        failed = write_streams(saving, rank, streams)
        # whether each rank's are written, to rank 0 (its gloo group: no save uses it now)
        said = [torch.zeros(1, dtype=torch.uint8) for _ in range(dist.get_world_size())]
        flag = torch.tensor([failed is not None], dtype=torch.uint8)
        dist.gather(flag, said if main else None, dst=0, group=self.group)
        serialized = checkpoint.serialized({**state, "format": FORMAT}) if main else b""
        future: Any = Future()
        copied = None
        if self.writes_tensors:
            import torch.distributed.checkpoint as dcp

            copying = time.perf_counter()
            saved = dcp.async_save(tensors, checkpoint_id=str(saving), process_group=self.group,
                                   async_stager=self.copier or self._stager(),
                                   no_dist=self.replicated)  # fmt: skip
            copied = None if self.copier else (copying, time.perf_counter())  # (DCP's: here)
            future = getattr(saved, "upload_completion", saved)  # (an AsyncSaveResponse)
        else:
            future.set_result(None)  # (rank 0 writes the tensors)
        others = main and any(bool(f) for r, f in enumerate(said) if r != rank)
        pending = _Pending(name, started, future, copied, serialized, failed, others)
        if main:
            pending.committer = threading.Thread(
                target=self._commit, args=(pending,), name="checkpoint-commit", daemon=True
            )
            pending.committer.start()
        self._pending = pending
        return name

    def _stager(self) -> Any:
        """The copy in memory a save writes from: kept from save to save, so a save after the
        first copies into the same buffers (no allocation, no page faults: half the time
        training waits). Safe: one save is in flight at a time. Where torch's ``async_save``
        closes the stager it is given after each save (torch before :data:`KEEPS_STAGER`: the
        next save then fails, ``KeyError: <class 'type'>``, seen with torch 2.11 on a GPU), a
        new one for each save."""
        if self._staging is None or not _keeps_stager():
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._staging = DefaultStager(StagingOptions(False, False, False, False))
        return self._staging

    def _commit(self, pending: _Pending) -> None:
        """(Rank 0, in a thread) Once every rank's part is written: the non-tensor state, the
        marker, the rename, the pruning."""
        try:
            pending.future.result()
            if pending.failed is not None or pending.others_failed:
                pending.outcome = {"streams": False}  # (each rank reports its own failure)
                return
            saving, final = self.folder / (pending.name + SAVING), self.folder / pending.name
            checkpoint.save(pending.state, saving / STATE)  # (disk full named)
            atomic.write_text(saving / COMMITTED, f"{time.time():.3f}\n")
            if (final / COMMITTED).is_file():  # the same step saved again (a resumed run
                shutil.rmtree(saving)  # stopped at once): the same state, keep the first
            else:
                os.replace(saving, final)
                atomic.fsync_dir(self.folder)
            for old in self.paths()[: -self.keep]:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
            done = time.perf_counter()
            # (the copier's times are set before its copy's Future, which the write awaited)
            start, end = pending.copied or self.copier.times  # type: ignore[union-attr]
            pending.outcome = {"written": Written(final, done - pending.started, end - start,
                                                  done - end)}  # fmt: skip
        except _FAILED as e:  # reported to every rank by wait()
            pending.outcome = {"error": e}

    def in_flight(self) -> bool:
        """Whether a save is still being copied or written."""
        pending = self._pending
        if pending is None:
            return False
        committing = pending.committer is not None and pending.committer.is_alive()
        return committing or not pending.future.done()

    def committed(self) -> Written | None:
        """(Rank 0) The save in flight once its commit is done, without waiting for it (no
        collective: :meth:`wait` still follows); None while it is written, or on other ranks."""
        pending = self._pending
        if pending is None or pending.committer is None or pending.committer.is_alive():
            return None
        return pending.outcome.get("written")

    def wait(self) -> Written | None:
        """Collective: wait for the save in flight, if any; on rank 0 what it cost. Raises
        CheckpointError on every rank if any rank's part (or rank 0's commit) failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error, saving = pending.failed, self.folder / (pending.name + SAVING)
        try:
            pending.future.result()
        except _FAILED as e:
            error = error or _failure(e, dist.get_rank(), saving)
        if pending.committer is not None:
            pending.committer.join()
            failed = pending.outcome.get("error")
            if failed is not None and error is None:
                error = _failure(failed, 0, saving)
        # whether any rank failed (a number a rank); only then which, and why
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed.item():
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error, group=self.group)
            if pending.committer is not None:  # rank 0: no half-written folder stays
                shutil.rmtree(self.folder / (pending.name + SAVING), ignore_errors=True)
            raise checkpoint.CheckpointError(next(e for e in errors if e is not None))
        if pending.committer is None:
            return None
        return pending.outcome["written"]

    # -- loading (collective) -------------------------------------------------------------
    def load(self, path: Path, tensors: dict[str, Any]) -> None:
        """Collective: read a checkpoint's tensors into ``tensors`` (resharded to this world
        size and these state dicts' layout): each rank its part, or (``replicated``) rank 0
        all of it, then broadcast to the others (:func:`from_rank0`)."""
        import torch.distributed.checkpoint as dcp

        def read() -> None:
            try:
                dcp.load(tensors, checkpoint_id=str(path), process_group=self.group,
                         no_dist=self.replicated)  # fmt: skip
            except Exception as e:
                raise checkpoint.CheckpointError(
                    f"{path}: unreadable sharded checkpoint ({type(e).__name__}: {e}); move "
                    "it out of the folder to resume from the one before"
                ) from e

        if not self.replicated:
            read()
            return
        error: checkpoint.CheckpointError | None = None
        failure: list[str | None] = [None]  # rank 0's message, broadcast
        if dist.get_rank() == 0:
            try:
                read()
            except checkpoint.CheckpointError as e:
                error, failure[0] = e, str(e)
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise error or checkpoint.CheckpointError(failure[0])
        from_rank0(tensors)


def from_rank0(state: dict[str, Any]) -> None:
    """Collective: rank 0's ``state`` (nested dicts and lists) on every rank: its tensors on
    the process group's device broadcast in place, one by one; its other values (and tensors
    elsewhere: an optimizer's step counts on the CPU) in one object broadcast."""
    device = _group_device()
    leaves: list[tuple[Any, Any]] = []
    _leaves(state, leaves)
    others: dict[int, Any] = {}
    for i, (holder, key) in enumerate(leaves):
        value = holder[key]
        if isinstance(value, torch.Tensor) and value.device == device:
            dist.broadcast(value, src=0)
        else:
            others[i] = value
    sent = [others]
    dist.broadcast_object_list(sent, src=0, device=device)
    for i, value in sent[0].items():
        holder, key = leaves[i]
        holder[key] = value


def _leaves(state: Any, found: list[tuple[Any, Any]]) -> None:
    """Append (container, key) of each value in ``state`` that is not a dict or list."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        if isinstance(value, dict | list):
            _leaves(value, found)
        else:
            found.append((state, key))


def _group_device() -> torch.device:
    """The device the default process group's collectives take (NCCL's GPU, else the CPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


KEEPS_STAGER = (2, 14)  # the first torch whose async_save leaves a stager it is given open


def _keeps_stager() -> bool:
    import torch

    release = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) for p in release[:2] if p.isdigit()) >= KEEPS_STAGER


def tensors_of(model: Any, optimizer: Any) -> dict[str, Any]:
    """Collective under FSDP: the model's and optimizer's state dicts as DCP saves and loads
    them (keyed by parameter name; each rank's shards under FSDP, full tensors under DDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def restore_tensors(model: Any, optimizer: Any, tensors: dict[str, Any]) -> None:
    """Load what :func:`tensors_of` gave (filled by :meth:`Store.load`) into the training."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optimizer"])  # fmt: skip


def full_state_dicts(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: an FSDP model's full weights and optimizer state, on rank 0's CPU (empty
    elsewhere), keyed by parameter name: the final checkpoint and ``model.pt``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))  # fmt: skip


# torch's writer when a write came short; DCP hands each rank's exception to the others
# pickled, without the OSError behind it, so a full disk reads "unexpected pos 704 vs 598".
SHORT_WRITE = "unexpected pos"
NEARLY_FULL_BYTES = 2**20  # less free than this: the disk is full


def _failure(e: BaseException, rank: int, where: Path) -> str:
    """A rank's message for its failed save, naming the folder (and the space left)."""
    found = _os_error(e)
    if not isinstance(found, OSError) and SHORT_WRITE in str(e) and _nearly_full(where):
        found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if isinstance(found, OSError) and found.filename is None:
        found = OSError(found.errno, found.strerror, str(where))
    return store_files.write_failure(found, rank)


def _nearly_full(folder: Path) -> bool:
    """Whether the file system of ``folder`` (or of its nearest existing parent) is full."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free < NEARLY_FULL_BYTES


def _os_error(e: BaseException) -> BaseException:
    """The OSError behind a failed save (DCP wraps each rank's in its own exceptions)."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        todo += [x for x in (current.__cause__, current.__context__) if x is not None]
        failures = getattr(current, "failures", None)  # DCP's CheckpointException: rank ->
        if isinstance(failures, dict):  # (exception, traceback)
            todo += [x[0] if isinstance(x, tuple) else x for x in failures.values()]
    return e


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint folder's non-tensor state (``weights_only``); CheckpointError if unusable."""
    if not (path / ".metadata").is_file():
        raise checkpoint.CheckpointError(f"{path}: no .metadata (an incomplete checkpoint)")
    try:
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise checkpoint.CheckpointError(
            f"{path}: unreadable {STATE} ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(state, dict) or not state.keys() >= REQUIRED_KEYS:
        raise checkpoint.CheckpointError(f"{path}: not a ddppipe checkpoint (missing keys)")
    if state["format"] != FORMAT:
        raise checkpoint.CheckpointError(f"{path}: format {state['format']}, expected {FORMAT}")
    return state
