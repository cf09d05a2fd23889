"""The run's data folder staged to node-local disk, once a node (``launch.stage_data``).

On a cluster the prepared data sits on the shared parallel filesystem, whose every open and
read is shared with all its users; a node's local disk (``$TMPDIR``, ``/local/scratch``) is
its own. With ``launch.stage_data`` set, the first process of a node to start copies the data
folder to ``<stage_data>/ddppipe-data-<digest>/`` (the manifest's digest: data of other
content never mixes), checking each file's SHA-256 against the manifest as it copies, into a
temporary folder renamed into place when complete; the node's other processes wait for it
(a lock) and every later slot or packed trial on that node that trains on the same data
reuses it (its files' sizes checked). The folder is named by its content, so it is never
stale; it is left for the node's own cleanup (a job's ``$TMPDIR`` goes with the job).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddppipe.core.errors import UserError
from ddppipe.data import manifest, squashfs

log = logging.getLogger(__name__)
CHUNK = 4 << 20


class StageError(RuntimeError, UserError):
    """The data cannot be staged where ``launch.stage_data`` says."""


def folder(setting: str) -> Path:
    """``launch.stage_data`` on this node: environment variables (``$TMPDIR``) and ``~``
    expanded; raise StageError when one is not set here."""
    expanded = os.path.expandvars(setting)
    if "$" in expanded:
        raise StageError(
            f"launch.stage_data {setting!r}: {expanded[expanded.index('$') :].split('/')[0]} is "
            f"not set on {socket.gethostname()}: name a folder that exists on every node, or "
            "set launch.stage_data: null (read the data where it was prepared)"
        )
    return Path(expanded).expanduser()


def staged(
    data_dir: Path, setting: str, found: dict[str, Any], progress: Callable[[], None]
) -> tuple[Path, bool]:
    """The data folder ``data_dir`` (of manifest ``found``) on this node's disk under
    ``setting``, and whether this process copied it (False: staged before, or by another
    process of the node while this one waited). ``progress`` is called every few seconds
    of the copy or the wait (a heartbeat). Raise StageError (no room, a file that does not
    match the manifest: nothing is left behind)."""
    root = folder(setting)
    dest = root / f"ddppipe-data-{found['digest']}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{dest.name}.lock", "a") as lock:
            while True:  # another process of the node may be copying: wait, alive
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    progress()
                    time.sleep(0.2)
            if (dest / manifest.NAME).is_file():
                _check_sizes(dest, found)
                return dest, False
            _copy(Path(data_dir), root, dest, found, progress)
            return dest, True
    except OSError as e:
        raise StageError(
            f"launch.stage_data: cannot stage {data_dir} into {root} on "
            f"{socket.gethostname()} ({e.strerror or e}): name a writable node-local folder, "
            "or set launch.stage_data: null"
        ) from None


def _check_sizes(dest: Path, found: dict[str, Any]) -> None:
    """Every file of the manifest in the staged copy ``dest``, of its size (not hashed: it
    was when copied); raise StageError."""
    if bad := manifest.differences(dest, found, hashes=False):
        raise StageError(
            f"{dest} was staged before but {bad[0][0]} is missing or of another size: remove "
            f"{dest} (the next process stages it again)"
        )


def _copy(data_dir: Path, root: Path, dest: Path, found: dict[str, Any],
          progress: Callable[[], None]) -> None:  # fmt: skip
    """Copy the manifest's files, checking each one's SHA-256, then rename into ``dest``."""
    needed = sum(f["bytes"] for f in found["files"].values())
    free = shutil.disk_usage(root).free
    if needed > free:
        raise StageError(
            f"launch.stage_data: the data ({needed / 1e9:,.2f} GB) does not fit in {root} on "
            f"{socket.gethostname()} ({free / 1e9:,.2f} GB free): name a larger node-local "
            "folder, or set launch.stage_data: null"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=root))
    try:
        for rel, want in found["files"].items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            with open(data_dir / rel, "rb") as src, open(target, "wb") as out:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    progress()
            if digest.hexdigest() != want["sha256"]:
                raise manifest.ManifestError(
                    f"{data_dir / rel} changed since it was prepared (its SHA-256 is not the "
                    f"manifest's): prepare the data again (delete {data_dir / manifest.NAME} "
                    "and run the prepare_data rule)"
                )
        shutil.copyfile(data_dir / manifest.NAME, tmp / manifest.NAME)  # last: complete
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("staged %s into %s (%d file(s), %.1f MB)", data_dir, dest, len(found["files"]),
             needed / 1e6)  # fmt: skip


def data_folder(
    data_dir: Path, setting: str | None, progress: Callable[[], None]
) -> tuple[Path, dict[str, Any]]:
    """The folder a rank reads its data from and the data's manifest: ``data_dir`` with every
    file checked against the manifest (``setting`` None), else its copy on this node
    (:func:`staged`: checked as it was copied)."""
    if setting is None:
        return Path(data_dir), manifest.check(data_dir)
    found = manifest.read(data_dir)
    dest, copied = staged(Path(data_dir), setting, found, progress)
    if not copied:
        log.info("the data staged on this node before: %s", dest)
    return dest, found


def for_rank(
    data_dir: Path, setting: str | None, args: dict[str, Any], held: contextlib.ExitStack,
    progress: Callable[[], None],
) -> tuple[Path, dict[str, Any], dict[str, Any]]:  # fmt: skip
    """What a rank reads: the data folder (:func:`data_folder`), its manifest, and the task's
    ``args`` reading a packed folder's image, mounted (or unpacked on the stage folder or
    ``$TMPDIR``) until ``held`` closes (:func:`ddppipe.data.squashfs.task_args`)."""
    folder_, found = data_folder(data_dir, setting, progress)
    local = folder(setting) if setting else Path(tempfile.gettempdir())
    return folder_, found, squashfs.task_args(folder_, found, args, local, held)
