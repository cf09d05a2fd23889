"""The digests of many files, kept between runs: a file is read again only when it changed.

A task's ``prepare`` that hashes every file of a large folder (``imagefolder``: a million
images) keeps each file's size, mtime and digest in the data folder's cache
(:data:`ddppipe.data.manifest.CACHE`, no data); the next run stats every file and reads only
those whose size or mtime differ (a file changed in place leaves its folder's mtime as it
was, so every file is stat-ed). The files come in groups (a class folder): the cache is one
compact file per group (a JSON header line; the sizes and mtimes as int64 pairs; the paths,
then the digests, NUL-separated), loaded and compared as arrays, written again (atomically)
only for a group where a file was read, added or removed; a group no longer there loses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ddppipe.core import atomic

FOLDER = "file-digests"  # in the data folder's cache
SUFFIX = ".stats"
FORMAT = 1
CHUNK = 2048  # files stat-ed by one task of the pool (a task a file costs more than its stat)
READ_CHUNK = 64  # files read by one task, at most
Cached = tuple[list[str], np.ndarray, list[str]]  # paths, (n, 2) sizes and mtimes, digests


def digests(
    root: Path,
    groups: Sequence[tuple[str, Sequence[str]]],
    cache: Path,
    digest: Callable[[Path], str],
    workers: int = 32,
) -> tuple[list[str], int]:
    """The digest of every file of ``groups`` (``(name, paths relative to root)``), in their
    order, and how many files ``digest`` read: one whose size and mtime are those the cache
    (folder ``cache``) recorded keeps its digest. Stats and reads run in ``workers`` threads
    (on a shared filesystem each is a round trip)."""
    folder = Path(cache) / FOLDER
    paths = [p for _, group in groups for p in group]
    found: list[str] = []  # "" until read
    fresh: list[int] = []
    rewrite: list[tuple[str, int, int]] = []
    with ThreadPoolExecutor(workers) as pool:
        stats = _stats(pool, str(root), paths)
        for name, group in groups:
            start, end = len(found), len(found) + len(group)
            old = _load(folder, name)
            part, stale = _reuse(old, list(group), stats[start:end])
            found += part
            fresh += [start + i for i in stale]
            if stale or old is None or len(old[0]) != len(group):  # a file read, or gone
                rewrite.append((name, start, end))
        read = _read(pool, root, [paths[i] for i in fresh], digest, workers)
    for i, d in zip(fresh, read, strict=True):
        found[i] = d
    for name, start, end in rewrite:
        _save(folder, name, paths[start:end], stats[start:end], found[start:end])
    _forget(folder, {_file(name) for name, _ in groups})
    return found, len(fresh)


def changed(
    root: Path,
    groups: Sequence[tuple[str, Sequence[str]]],
    cache: Path,
    expected: Sequence[str],
    digest: Callable[[Path], str],
    workers: int = 32,
) -> tuple[list[str], int]:
    """The files of ``groups`` whose digest is no longer ``expected`` (theirs, in order), and
    how many files were read: a file whose size and mtime are those the cache (folder
    ``cache``) recorded with the expected digest is unchanged unread; any other (its size or
    mtime moved, or no record: a data folder without its cache) is read and compared."""
    folder = Path(cache) / FOLDER
    paths = [p for _, group in groups for p in group]
    stale: list[int] = []
    with ThreadPoolExecutor(workers) as pool:
        stats = _stats(pool, str(root), paths)
        start = 0
        for name, group in groups:
            end = start + len(group)
            cached, unread = _reuse(_load(folder, name), list(group), stats[start:end])
            stale += [start + i for i in unread]
            stale += [i for i in range(start, end)
                      if cached[i - start] and cached[i - start] != expected[i]]  # fmt: skip
            start = end
        read = _read(pool, root, [paths[i] for i in stale], digest, workers)
    bad = {i for i, d in zip(stale, read, strict=True) if d != expected[i]}
    return [paths[i] for i in sorted(bad)], len(stale)


def _stats(pool: ThreadPoolExecutor, root: str, paths: list[str]) -> np.ndarray:
    """Every file's size and mtime (ns), an ``(n, 2)`` int64 array, stat-ed in chunks."""

    def chunk(lo: int) -> list[int]:
        found: list[int] = []
        for path in paths[lo : lo + CHUNK]:
            st = os.stat(f"{root}/{path}")
            found += (st.st_size, st.st_mtime_ns)
        return found

    flat = [x for part in pool.map(chunk, range(0, len(paths), CHUNK)) for x in part]
    return np.array(flat, dtype=np.int64).reshape(len(paths), 2)


def _read(pool: ThreadPoolExecutor, root: Path, paths: list[str],
          digest: Callable[[Path], str], workers: int) -> list[str]:  # fmt: skip
    """``digest`` of each of ``paths``, in chunks spread over the ``workers`` threads (a
    million futures, one a file, would cost more memory and time than the files)."""
    size = max(1, min(READ_CHUNK, -(-len(paths) // workers)))

    def chunk(lo: int) -> list[str]:
        return [digest(root / path) for path in paths[lo : lo + size]]

    return [d for part in pool.map(chunk, range(0, len(paths), size)) for d in part]


def _reuse(old: Cached | None, paths: list[str],
           stats: np.ndarray) -> tuple[list[str], list[int]]:  # fmt: skip
    """The cached digest of each of ``paths`` whose size and mtime are the cache's ("" for
    the others), and the indices of those others: to read."""
    if old is None or not old[0]:
        return [""] * len(paths), list(range(len(paths)))
    old_paths, old_stats, old_digests = old
    if old_paths == paths:
        rows = np.arange(len(paths))
    else:
        where = {p: i for i, p in enumerate(old_paths)}
        rows = np.array([where.get(p, -1) for p in paths], dtype=np.int64)
    same = (rows >= 0) & (old_stats[rows] == stats).all(axis=1)
    keep = same.tolist()
    part = [old_digests[r] if k else "" for r, k in zip(rows.tolist(), keep, strict=True)]
    return part, np.flatnonzero(~same).tolist()


def _file(name: str) -> str:
    """A group's cache file: named by its name's hash (a class name may be any text)."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:24] + SUFFIX


def _load(folder: Path, name: str) -> Cached | None:
    """The cache of group ``name``; None when missing, unreadable or not this group's."""
    try:
        data = (folder / _file(name)).read_bytes()
        head, _, body = data.partition(b"\n")
        header = json.loads(head)
        n = header["count"]
        if header.get("format") != FORMAT or header.get("group") != name or len(body) < 16 * n:
            return None
        stats = np.frombuffer(body, "<i8", 2 * n).reshape(n, 2)
        text = body[16 * n :].decode("utf-8", "surrogateescape").split("\0") if n else []
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(text) != 2 * n:
        return None
    return text[:n], stats, text[n:]


def _save(folder: Path, name: str, paths: Sequence[str], stats: np.ndarray,
          found: Sequence[str]) -> None:  # fmt: skip
    header = json.dumps({"format": FORMAT, "group": name, "count": len(paths)})
    text = "\0".join([*paths, *found]).encode("utf-8", "surrogateescape")
    data = header.encode() + b"\n" + stats.astype("<i8").tobytes() + text
    atomic.write_bytes(folder / _file(name), data, durable=False)


def _forget(folder: Path, keep: set[str]) -> None:
    """Remove the cache files of groups no longer there."""
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.endswith(SUFFIX) and path.name not in keep:
                path.unlink(missing_ok=True)
