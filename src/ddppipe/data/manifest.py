"""The data manifest: every file a task's ``prepare`` left, with its size and SHA-256.

Written last by ``ddppipe prepare`` (its existence means the data is complete), recorded in
the provenance, checked by every rank before training, and hashed into the training
config's identity: checkpoints of other data are never resumed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, hashing
from ddppipe.core.errors import UserError

NAME = "manifest.json"
# A folder of the data folder where a task's prepare keeps what speeds up its next run (e.g.
# the files' stat cache): no data, in no manifest.
CACHE = ".cache"
# A file modified less than this before the manifest was written has no recorded mtime: it is
# hashed at every check (git's "racily clean" entries), the others only when their mtime moved.
RACY_NS = 2_000_000_000


class ManifestError(RuntimeError, UserError):
    """The data folder does not match its manifest (or has none)."""


def _files(data_dir: Path) -> list[Path]:
    return sorted(
        p for p in data_dir.rglob("*")
        if p.is_file() and p.name != NAME and atomic.temp_target(p.name) is None
        and p.relative_to(data_dir).parts[0] != CACHE
    )  # fmt: skip


def build(data_dir: Path, task: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Every file's size and SHA-256, and its mtime where it is older than :data:`RACY_NS`
    (a file changed within the same clock tick as its recorded mtime would keep it)."""
    files = {}
    for p in _files(data_dir):
        stat = p.stat()
        files[str(p.relative_to(data_dir))] = {
            "bytes": stat.st_size, "sha256": hashing.file_sha256(p),
            **({"mtime_ns": stat.st_mtime_ns}
               if stat.st_mtime_ns < time.time_ns() - RACY_NS else {}),
        }  # fmt: skip
    return {"task": task, "args": args, "files": files, "digest": digest(files)}


def digest(files: dict[str, Any]) -> str:
    """One hash of the files' names and contents (order-independent)."""
    blob = json.dumps({k: v["sha256"] for k, v in files.items()}, sort_keys=True).encode()
    return hashing.sha256(blob)[:16]


def write(
    data_dir: Path, task: dict[str, Any], args: dict[str, Any],
    records: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Hash what ``prepare`` left in ``data_dir`` and write the manifest there, atomically;
    ``records``: more of its entries (the SquashFS image: :mod:`ddppipe.data.squashfs`)."""
    found = {**build(Path(data_dir), task, args), **(records or {})}
    if not found["files"]:
        raise ManifestError(
            f"task {task.get('ref')}: prepare() left no file in {data_dir}; it must write its "
            "data (or an index of it) there"
        )
    atomic.write_json(Path(data_dir) / NAME, found)
    return found


def read(data_dir: Path) -> dict[str, Any]:
    path = Path(data_dir) / NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(
            f"{path} missing: the data was never prepared; run the prepare_data rule "
            "(or `ddppipe prepare`) first"
        ) from None


def differences(
    data_dir: Path, found: dict[str, Any], hashes: bool = True
) -> list[tuple[str, str]]:
    """The files of manifest ``found`` that ``data_dir`` does not hold as recorded, each as
    ``(file, "missing" or "changed since it was prepared")``: its size compared and, with
    ``hashes``, its SHA-256 where its mtime is not the recorded one (the one check of a data
    folder, staged or not: a data folder of shards larger than a node's disk is stat-ed by
    each rank, not read)."""
    bad = []
    for rel, want in found["files"].items():
        path = Path(data_dir) / rel
        try:
            stat = path.stat()
        except FileNotFoundError:
            bad.append((rel, "missing"))
            continue
        if stat.st_size != want["bytes"] or (
            hashes and stat.st_mtime_ns != want.get("mtime_ns")
            and hashing.file_sha256(path) != want["sha256"]
        ):  # fmt: skip
            bad.append((rel, "changed since it was prepared"))
    return bad


def check(data_dir: Path) -> dict[str, Any]:
    """The manifest, after checking every file's size and (its mtime moved) SHA-256; raise
    ManifestError."""
    found = read(data_dir)
    if bad := differences(data_dir, found):
        raise ManifestError(
            f"{data_dir} does not match its {NAME}: "
            f"{'; '.join(f'{rel}: {what}' for rel, what in bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}. Delete {Path(data_dir) / NAME} and run the "
            "prepare_data rule again"
        )
    return found
