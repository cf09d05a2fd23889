"""A folder of many files packed once into one read-only SquashFS image (``data.pack: squashfs``).

On a shared parallel filesystem every file opened is a round trip to a metadata server that all
its users share; an image is one file. ``ddppipe prepare`` writes the folder a task reads (the
one its ``FOLDER_ARG`` names: ``imagefolder``'s ``task_args.root``, the images as files,
undecoded) into the data folder as ``<arg>-<digest>.sqfs``, named by the image's own SHA-256,
and records it in the data manifest (``"squashfs": {"image": ..., "arg": ...}``). The image is
deterministic (files sorted, owner root, every time 0, modes 0644 and 0755 whatever the
umask): the same content gives the same name.

Training reads it where the task expects its folder, the task's code unchanged:

- ``container.mode: apptainer``: ``apptainer exec --bind IMAGE:FOLDER:image-src=/`` on every
  node (:func:`Image.bind`), over the folder's own path;
- locally and on SLURM without a container: each process mounts it with ``squashfuse`` on a
  folder of its own (unmounted when it ends; a mount left by a killed process is removed by the
  next one) and gives the task that folder (:func:`Image.mounted`); where FUSE does not work,
  the first process of a node unpacks it once (``unsquashfs``) into
  ``<local>/ddppipe-<uid>/sqfs-<digest>/``, which the node's other processes and later runs
  reuse (renamed into place when complete: its completion mark; the others wait for it, a
  lock with a bound, beating their heartbeat while the unpacking progresses).

Mount points and unpacked copies live in this user's private folder of the node-local one
(:func:`ddppipe.core.private.user_folder`: mode 0700, checked before use), where no other user
can plant, block or read anything.

With ``launch.stage_data`` the image, a file of the data folder, is staged like the others
(one file copied a node) and mounted or unpacked there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import hashing, nodelock, private, system
from ddppipe.core.errors import UserError
from ddppipe.data import manifest

log = logging.getLogger(__name__)

SUFFIX = ".sqfs"
KEY = "squashfs"  # the data manifest's record of the image
# Deterministic: no append to an old image, every file owned by root, every time (the image's
# and its files') 0, no extended attributes; mksquashfs sorts each folder's entries itself.
# Readable by every user whatever the umask the folder was written under (pip under `umask
# 077` writes 0600 and 0700, which root's ownership would make unreadable where Apptainer
# mounts the image with the kernel): files 0644, folders and executables 0755. The arguments
# of every image ddppipe packs: a data folder's, a task's layer (ddppipe.apptainer.layer).
MODES = "chmod(a=rX,u+w)@true"  # X: executable where a folder or executable by anyone
MKSQUASHFS_ARGS = ("-noappend", "-all-root", "-mkfs-time", "0", "-all-time", "0",
                   "-no-xattrs", "-action", MODES, "-no-progress", "-quiet")  # fmt: skip
MKSQUASHFS, UNSQUASHFS, SQUASHFUSE = "mksquashfs", "unsquashfs", "squashfuse"
MKSQUASHFS_MIN = (4, 4)  # -mkfs-time and -all-time (RHEL 8 ships 4.3)
# In this user's private folder: sqfs-<digest>.<pid> a process's mount, sqfs-<digest> the
# image unpacked.
NAME_PREFIX = "sqfs-"
POLL_S = 0.2


class SquashfsError(RuntimeError, UserError):
    """The image cannot be written, mounted or unpacked."""


def _tool(name: str, purpose: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise SquashfsError(
            f"data.pack: squashfs needs {name} to {purpose}, and it is not on PATH: install "
            "squashfs-tools (apt install squashfs-tools squashfuse; `make system-deps`), or set "
            "data.pack: none"
        )
    return found


def version_problem(
    printed: str, needed_by: str = "data.pack: squashfs", instead: str = "set data.pack: none"
) -> str | None:
    """Why the mksquashfs that printed ``printed`` (its ``-version``) cannot write the image
    that ``needed_by`` asks for (``instead``: the other way), or None."""
    found = re.search(r"mksquashfs version (\d+)\.(\d+)", printed)
    if found is None:
        return None  # (an unknown build: its own error, if any, comes when it runs)
    version = (int(found.group(1)), int(found.group(2)))
    if version >= MKSQUASHFS_MIN:
        return None
    return (
        f"{needed_by} needs squashfs-tools {'.'.join(map(str, MKSQUASHFS_MIN))} or "
        f"newer (its -mkfs-time and -all-time make the image the same bytes every time), and "
        f"this mksquashfs is {version[0]}.{version[1]}: install a newer squashfs-tools (or put "
        f"one first on PATH), or {instead}"
    )


def _links(folder: Path, most: int = 3) -> list[Path]:
    """Up to ``most`` symbolic links under ``folder`` (files or folders)."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):
        found += [Path(root, n) for n in dirs + files if Path(root, n).is_symlink()]
        if len(found) >= most:
            break
    return found[:most]


def _io(pid: int) -> str | None:
    """What process ``pid`` has read and written so far (None: unknown here)."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return None
    return " ".join(x for x in lines if x.startswith(("rchar", "wchar")))


def _run(argv: list[str], what: str, beat: Callable[[], None] | None = None) -> None:
    """Run ``argv``; ``beat`` called every :data:`POLL_S` in which it read or wrote (every one
    where that is unknown): one that hangs stops beating. Raise SquashfsError."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            seen: str | None = None
            while proc.poll() is None:
                if beat is not None and ((now := _io(proc.pid)) is None or now != seen):
                    beat()
                    seen = now
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(POLL_S)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            out.seek(0)
            tail = out.read().strip().splitlines()[-3:]
            raise SquashfsError(f"{what} failed (exit {proc.returncode}): {' / '.join(tail)}")


def write(folder: Path, data_dir: Path, stem: str) -> str:
    """Pack ``folder`` into ``data_dir/<stem>-<digest>.sqfs`` and return that file's name;
    earlier images of ``stem`` are removed. Written beside under a temporary name and renamed
    when complete: a failed write leaves nothing. Raise SquashfsError."""
    tool = _tool(MKSQUASHFS, "write the image")
    folder, data_dir = Path(folder), Path(data_dir)
    if not folder.is_dir():
        raise SquashfsError(f"data.pack: squashfs: no folder {folder.absolute()} to pack")
    printed = subprocess.run([tool, "-version"], capture_output=True, text=True, check=False)
    problem = version_problem(printed.stdout + printed.stderr)
    if problem:
        raise SquashfsError(problem)
    links = _links(folder)
    if links:  # mksquashfs stores a link as a link: read outside the image, or broken in it
        named = ", ".join(f"{p.relative_to(folder)} -> {os.readlink(p)}" for p in links)
        raise SquashfsError(
            f"data.pack: squashfs: {folder} holds symbolic links ({named}): the image would "
            "keep them as links, which point outside it (read past its digest) or nowhere. "
            "Replace them with the files they point to (cp -rL), or set data.pack: none"
        )
    # A name the data manifest leaves out (ddppipe.core.atomic's temporary files).
    fd, name = tempfile.mkstemp(prefix=f".{stem}{SUFFIX}.", suffix=".tmp", dir=data_dir)
    os.close(fd)
    tmp = Path(name)
    try:
        _run([tool, str(folder), str(tmp), *MKSQUASHFS_ARGS], f"mksquashfs {folder}")
        dest = data_dir / f"{stem}-{hashing.file_sha256(tmp)[:16]}{SUFFIX}"
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for old in data_dir.glob(f"{stem}-*{SUFFIX}"):
        if old != dest:
            old.unlink()
    return dest.name


@dataclass(frozen=True)
class Image:
    """A data folder's image (its manifest's record) and the task argument it stands for."""

    path: Path
    arg: str

    @classmethod
    def of(cls, data_dir: Path, found: dict[str, Any]) -> Image | None:
        """The image of the data folder ``data_dir`` whose manifest is ``found``; None when
        its data is not packed."""
        record = found.get(KEY)
        if record is None:
            return None
        return cls(Path(data_dir) / record["image"], record["arg"])

    @property
    def digest(self) -> str:
        return self.path.stem.rsplit("-", 1)[-1]

    def _target(self, args: dict[str, Any]) -> str:
        return os.path.abspath(os.path.expanduser(args[self.arg]))

    def bind(self, args: dict[str, Any]) -> tuple[str, str]:
        """The image's path and the task's folder (``args[arg]``, made absolute: the working
        directory is the same inside) that ``apptainer exec`` binds its content over
        (``image-src=/``: :func:`ddppipe.apptainer.running.data_binds`)."""
        return str(self.path.resolve()), self._target(args)

    def bound(self, args: dict[str, Any]) -> bool:
        """Whether this process runs in an Apptainer image with a mount over the task's
        folder (:meth:`bind`)."""
        in_image = os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")
        return bool(in_image) and os.path.ismount(self._target(args))

    @contextlib.contextmanager
    def mounted(self, local: Path, progress: Callable[[], None]) -> Iterator[Path]:
        """The image's content as a folder while in the block: mounted with squashfuse for
        this process, else (no FUSE here: logged) unpacked once a node under ``local``
        (``progress`` called every few seconds of the unpacking or the wait for it)."""
        point = _mount(self.path, self.digest)
        if point is None:
            yield _unpacked(self.path, self.digest, Path(local), progress)
            return
        try:
            yield point
        finally:
            _unmount(point)


def _unmount(point: Path) -> None:
    """Detach a mount (lazily: a DataLoader worker may still hold a file) and remove its
    folder; quiet when it is no mount (any more)."""
    for argv in (["fusermount3", "-u", "-z"], ["fusermount", "-u", "-z"], ["umount", "-l"]):
        if shutil.which(argv[0]):
            subprocess.run([*argv, str(point)], capture_output=True, stdin=subprocess.DEVNULL)
            break
    with contextlib.suppress(OSError):
        point.rmdir()


def _remove_stale(mine: Path) -> None:
    """The mounts that processes killed before their end left in ``mine``, removed."""
    for point in mine.glob(f"{NAME_PREFIX}*.*"):
        pid = point.suffix.lstrip(".")
        if pid.isdigit() and not system.process_alive(int(pid)):
            log.info("removing %s, the mount of an ended process", point)
            _unmount(point)


def _mount(image: Path, digest: str) -> Path | None:
    """The image mounted with squashfuse on a folder of this process's; None where squashfuse
    is missing or cannot mount here (the reason logged)."""
    tool = shutil.which(SQUASHFUSE)
    if tool is None:
        log.warning("data.pack: squashfs: no %s here: the image is unpacked to node-local disk "
                    "instead (install squashfuse to mount it)", SQUASHFUSE)  # fmt: skip
        return None
    mine = private.user_folder(Path(tempfile.gettempdir()))
    _remove_stale(mine)
    point = mine / f"{NAME_PREFIX}{digest}.{os.getpid()}"
    if point.exists():  # this pid's, left by an earlier process of the same number
        _unmount(point)
    point.mkdir()
    done = subprocess.run([tool, str(image), str(point)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    if done.returncode != 0 or not os.path.ismount(point):
        with contextlib.suppress(OSError):
            point.rmdir()
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["not mounted"]
        log.warning("data.pack: squashfs: squashfuse cannot mount %s here (%s): the image is "
                    "unpacked to node-local disk instead", image, why[0])  # fmt: skip
        return None
    log.info("mounted %s on %s (squashfuse)", image, point)
    return point


def _unpacked(image: Path, digest: str, local: Path, progress: Callable[[], None]) -> Path:
    """The image's content unpacked into ``<local>/ddppipe-<uid>/sqfs-<digest>/``: by the
    first process of the node, into a temporary folder renamed into place (the mark of a
    complete copy); the others wait for it (:func:`ddppipe.core.nodelock.held`) and every
    later one reuses it."""
    mine = private.user_folder(local)
    dest = mine / f"{NAME_PREFIX}{digest}"
    with nodelock.held(mine, dest.name, progress) as holder:
        if dest.is_dir() and not dest.is_symlink():
            return dest
        tool = _tool(UNSQUASHFS, f"unpack {image} where squashfuse cannot mount it")
        tmp = nodelock.temporary(mine, dest.name)
        try:
            _run([tool, "-no-progress", "-d", str(tmp), str(image)], f"unsquashfs {image}",
                 holder.beat)  # fmt: skip
            os.rename(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                nodelock.remove(tmp)
            raise
    log.info("unpacked %s into %s", image, dest)
    return dest


def task_args(
    data_dir: Path, found: dict[str, Any], args: dict[str, Any], local: Path,
    held: contextlib.ExitStack, progress: Callable[[], None],
) -> dict[str, Any]:  # fmt: skip
    """The task's ``args`` reading the data folder ``data_dir`` (manifest ``found``): as they
    are where the data is not packed or its image is bound over the task's folder, else with
    that folder replaced by the image's content, mounted (or unpacked under ``local``,
    ``progress`` its heartbeat) until ``held`` closes."""
    image = Image.of(data_dir, found)
    if image is None or image.bound(args):
        return args
    return {**args, image.arg: str(held.enter_context(image.mounted(local, progress)))}


@contextlib.contextmanager
def reading(data_dir: Path, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """:func:`task_args` of the data folder ``data_dir`` (its manifest read here) for one
    process that is no training rank (``ddppipe evaluate``, ``time-loader``): the image
    mounted, or unpacked under ``$TMPDIR``, while in the block."""
    with contextlib.ExitStack() as held:
        yield task_args(Path(data_dir), manifest.read(data_dir), args,
                        Path(tempfile.gettempdir()), held, lambda: None)  # fmt: skip
