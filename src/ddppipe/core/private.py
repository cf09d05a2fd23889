"""Folders only this user can touch: the one check of a private folder, and this user's own
folder in a node-local one everybody shares (``/tmp``, ``$TMPDIR``, a stage folder).

A name in a shared folder is anybody's to take first: every folder ddppipe makes or reuses
there (staged data, unpacked images, mount points, their locks) lives inside
``<base>/ddppipe-<uid>/``, made mode 0700 and checked before each use (a folder, not a link,
owned by this user, no access for group or others). Inside it no other user can create,
change or read anything; a folder of that name that fails the check is never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from pathlib import Path

from ddppipe.core.errors import UserError

log = logging.getLogger(__name__)

PREFIX = "ddppipe-"
TRIES = 8  # <base>/ddppipe-<uid>, then ddppipe-<uid>.1 ... .7 where the name is taken


class NotPrivate(RuntimeError, UserError):
    """A folder another user could read or change where ddppipe needs one of its user's own."""


def owner(uid: int) -> str:
    """A user's name and uid (the uid alone where the name is unknown)."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def problem(folder: Path) -> str | None:
    """Why ``folder`` is no private folder of this user (None: it is one): missing, a
    symbolic link, no folder, another user's, or open to its group or to others."""
    try:
        info = folder.lstat()  # (never follows a link)
    except FileNotFoundError:
        return f"{folder} does not exist"
    mode = stat.filemode(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        return f"{folder} is a symbolic link ({os.readlink(folder)}), no folder of this user's"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} ({mode}) is no folder"
    if info.st_uid != os.getuid():
        return (f"{folder} ({mode}) is owned by {owner(info.st_uid)}, not by this user "
                f"({owner(os.getuid())})")  # fmt: skip
    if info.st_mode & 0o077:
        return f"{folder} ({mode}, this user's) is open to other users: chmod 700 {folder}"
    return None


def _shared_unsafely(base: Path) -> str | None:
    """Why another user could swap this user's folder in ``base`` for one of theirs (None:
    they cannot): ``base`` is another user's, or writable by others and not sticky (``/tmp``
    is sticky: only an entry's owner renames it)."""
    info = base.stat()
    mode, by = stat.filemode(info.st_mode), owner(info.st_uid)
    if info.st_uid not in (0, os.getuid()):
        return f"{base} ({mode}) is owned by {by}, who may rename what it holds"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return (f"{base} ({mode}, owned by {by}) lets other users rename what it holds (it is "
                "writable by them and not sticky)")  # fmt: skip
    return None


def user_folder(base: Path) -> Path:
    """This user's private folder in the shared folder ``base`` (made where missing):
    ``<base>/ddppipe-<uid>``, made mode 0700, checked (:func:`problem`). Where that name is
    taken by a folder that fails the check (another user's, one open to others, a link), it
    is left untouched and unread, a warning names it, and the first of
    ``ddppipe-<uid>.1`` ... ``.7`` that passes or can be made is used: all processes of the
    node settle on the same one. Raise NotPrivate when ``base`` lets others rename its
    entries or no name passes."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    if why := _shared_unsafely(base):
        raise NotPrivate(f"{why}: give ddppipe a folder of your own, or a sticky one (chmod "
                         "+t, as /tmp), for its node-local files")  # fmt: skip
    refused: list[str] = []
    for n in range(TRIES):
        candidate = base / f"{PREFIX}{os.getuid()}{f'.{n}' if n else ''}"
        with contextlib.suppress(FileExistsError):
            candidate.mkdir(mode=0o700)
            os.chmod(candidate, 0o700)  # (a umask may have taken more)
        why = problem(candidate)
        if why is None:
            if refused:
                log.warning("%s: not used (nothing in it read); using %s instead. Remove it "
                            "(its owner or an administrator can)", "; ".join(refused),
                            candidate)  # fmt: skip
            return candidate
        refused.append(why)
    raise NotPrivate(
        f"no private folder of this user's can be made in {base}: {'; '.join(refused)}. Remove "
        f"them (their owner or an administrator can), or name another node-local folder"
    )
