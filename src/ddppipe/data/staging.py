"""The run's data folder staged to node-local disk, once a node (``launch.stage_data``).

On a cluster the prepared data sits on the shared parallel filesystem, whose every open and
read is shared with all its users; a node's local disk (``$TMPDIR``, ``/local/scratch``) is
its own. With ``launch.stage_data`` set, the first process of a node to start copies the data
folder into this user's private folder there (mode 0700, checked:
:func:`ddppipe.core.private.user_folder`), as ``<stage_data>/ddppipe-<uid>/data-<digest>/``
(the manifest's digest: data of other content never mixes), checking each file's SHA-256
against the manifest as it copies, into a temporary folder renamed into place when complete
(its manifest copied last); the node's other processes wait for it (a lock with a bound:
:mod:`ddppipe.core.nodelock`) and every later slot or packed trial on that node that trains
on the same data reuses it (its manifest's digest and its files' sizes checked; an
incomplete copy is replaced). The folder is named by its content, so it is never stale; it
is left for the node's own cleanup (a job's ``$TMPDIR`` goes with the job).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddppipe.core import nodelock, private
from ddppipe.core.errors import UserError
from ddppipe.data import manifest, squashfs

log = logging.getLogger(__name__)
CHUNK = 4 << 20
NAME_PREFIX = "data-"  # <this user's folder>/data-<digest>: a staged copy


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
    """The data folder ``data_dir`` (of manifest ``found``) on this node's disk, in this
    user's private folder under ``setting`` (:func:`ddppipe.core.private.user_folder`), and
    whether this process copied it (False: staged before, or by another process of the node
    while this one waited). ``progress`` is called every few seconds of the copy or the wait
    (a heartbeat). Raise StageError (no room, a file that does not match the manifest:
    nothing is left behind)."""
    root = folder(setting)
    name = f"{NAME_PREFIX}{found['digest']}"
    try:
        mine = private.user_folder(root)
        dest = mine / name
        with nodelock.held(mine, name, progress) as holder:  # another process may be copying
            if dest.exists() or dest.is_symlink():
                if (why := _incomplete(dest, found)) is None:
                    return dest, False
                log.warning("%s: staging it again", why)
                nodelock.remove(dest)
            _copy(Path(data_dir), mine, dest, found, holder.beat)
            return dest, True
    except OSError as e:
        raise StageError(
            f"launch.stage_data: cannot stage {data_dir} into {root} on "
            f"{socket.gethostname()} ({e.strerror or e}{f': {e.filename}' if e.filename else ''}"
            "): name a writable node-local folder, or set launch.stage_data: null"
        ) from None


def _incomplete(dest: Path, found: dict[str, Any]) -> str | None:
    """Why the earlier copy ``dest`` is not the complete copy of the data of manifest
    ``found`` (None: it is): its manifest, copied last, missing or of other data, or a file
    missing or of another size (not hashed: it was when copied)."""
    if not dest.is_dir() or dest.is_symlink():
        return f"{dest} is no folder"
    try:
        staged_digest = json.loads((dest / manifest.NAME).read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return f"{dest} has no readable {manifest.NAME} (a copy that did not complete)"
    if staged_digest != found["digest"]:
        return f"{dest}'s {manifest.NAME} is of other data (digest {staged_digest})"
    if bad := manifest.differences(dest, found, hashes=False):
        return f"{dest} (staged before): {bad[0][0]} {bad[0][1]}"
    return None


def _copy(data_dir: Path, mine: Path, dest: Path, found: dict[str, Any],
          beat: Callable[[], None]) -> None:  # fmt: skip
    """Copy the manifest's files, checking each one's SHA-256, then rename into ``dest``."""
    needed = sum(f["bytes"] for f in found["files"].values())
    free = shutil.disk_usage(mine).free
    if needed > free:
        raise StageError(
            f"launch.stage_data: the data ({needed / 1e9:,.2f} GB) does not fit in {mine} on "
            f"{socket.gethostname()} ({free / 1e9:,.2f} GB free): name a larger node-local "
            "folder, or set launch.stage_data: null"
        )
    tmp = nodelock.temporary(mine, dest.name)
    tmp.mkdir()
    try:
        for rel, want in found["files"].items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            with open(data_dir / rel, "rb") as src, open(target, "wb") as out:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    beat()
            if digest.hexdigest() != want["sha256"]:
                raise manifest.ManifestError(
                    f"{data_dir / rel} changed since it was prepared (its SHA-256 is not the "
                    f"manifest's): prepare the data again (delete {data_dir / manifest.NAME} "
                    "and run the prepare_data rule)"
                )
        shutil.copyfile(data_dir / manifest.NAME, tmp / manifest.NAME)  # last: complete
        os.rename(tmp, dest)
    except BaseException:
        nodelock.remove(tmp)
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
    ``$TMPDIR``) until ``held`` closes (:func:`ddppipe.data.squashfs.task_args`); ``progress``
    called every few seconds of a copy, an unpacking or a wait for one (a heartbeat)."""
    folder_, found = data_folder(data_dir, setting, progress)
    local = folder(setting) if setting else Path(tempfile.gettempdir())
    return folder_, found, squashfs.task_args(folder_, found, args, local, held, progress)
