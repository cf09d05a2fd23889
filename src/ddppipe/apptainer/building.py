"""Building an image: ``apptainer build`` atomically, with the wheelhouse and build arguments."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddppipe.apptainer import room
from ddppipe.apptainer.tool import APPTAINER, ContainerError
from ddppipe.core import system

log = logging.getLogger(__name__)
BUILD_OPTIONS = ("--fakeroot", "--force", "--mksquashfs-args", "-comp zstd -Xcompression-level 3")
WHEELHOUSE = "build/wheels"  # below the build context: torch's wheels, shared with the host
WHEELHOUSE_IN_IMAGE = "/opt/wheelhouse"


def build_args(context: Path) -> list[str]:
    """``--build-arg`` options: ddppipe's version and the git commit of ``context``."""
    from ddppipe import __version__

    git = system.git_commit(context)
    commit = git["commit"] or "unknown"
    if git["dirty"]:
        commit += "-dirty"
    return ["--build-arg", f"DDPPIPE_VERSION={__version__}", "--build-arg", f"GIT_COMMIT={commit}"]


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def fill_wheelhouse(context: Path, log: Any) -> Path | None:
    """``pip download`` the pinned torch and its wheels into ``context/build/wheels``.

    With the host's pip, so its cache, mirrors and indexes serve them: the image build then
    installs the multi-GB CUDA wheels from there instead of downloading them again. None
    (the build's pip uses PyPI) when there is no pin or the download fails.
    """
    constraints = context / "constraints.txt"
    if not constraints.is_file():
        return None
    dest = context / WHEELHOUSE
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
               "--constraint", str(constraints), "torch"]  # fmt: skip
    log.write(f"# {' '.join(command)}\n")
    log.flush()
    if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode:
        log.write("# (no wheelhouse: the build downloads torch from PyPI)\n")
        return None
    return dest


def _building(image: Path, pid: int | str) -> Path:
    """The file a build of ``image`` by process ``pid`` of this host writes first (``"*"``:
    the pattern of every such file)."""
    return image.with_name(f".{image.name}.{socket.gethostname()}.{pid}.building")


def remove_killed_builds(image: Path) -> None:
    """The files that builds of ``image`` on this host left when killed before their end
    removed: each is as large as the image (a build on another host sharing the folder is
    left alone)."""
    for path in image.parent.glob(_building(image, "*").name):
        pid = path.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not system.process_alive(int(pid)):
            log.info("removing %s, left by a build that ended before it was complete", path)
            path.unlink(missing_ok=True)


def build(
    recipe: Path,
    image: Path,
    log: Path,
    context: Path,
    timeout_s: float = 3600,
    arguments: list[str] | None = None,
) -> None:
    """``apptainer build`` ``recipe`` into ``image``, atomically, run in ``context``.

    The recipe's %files paths are relative to ``context`` (the repository root). The image
    is built into a temporary file next to ``image`` and renamed only on success, so a
    failed build never leaves a half-written image where the next step would use it.
    The wheelhouse (:func:`fill_wheelhouse`) is bound in at ``/opt/wheelhouse``. What killed
    builds left is removed (:func:`remove_killed_builds`); a build that would not fit on disk
    is then refused before it starts (:mod:`ddppipe.apptainer.room`).
    ``arguments``: the ``--build-arg`` options (default :func:`build_args`; apptainer
    refuses ones the recipe does not use).
    """
    recipe, image, log, context = (Path(p).resolve() for p in (recipe, image, log, context))
    if not recipe.is_file():
        raise ContainerError(f"container recipe {recipe} not found (config container.recipe)")
    if shutil.which(APPTAINER) is None:
        raise ContainerError(
            "apptainer is not on PATH: install it (.ci/install_apptainer.sh on Debian) "
            "or set container.mode: none"
        )
    image.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_builds(image)
    tmp = _building(image, os.getpid())
    try:
        with open(log, "w") as f:
            wheels = fill_wheelhouse(context, f)
            try:
                room.check(wheels, image)
            except ContainerError as e:
                f.write(f"# refused: {e}\n")
                raise
            bind = ["--bind", f"{wheels}:{WHEELHOUSE_IN_IMAGE}:ro"] if wheels else []
            args = build_args(context) if arguments is None else arguments
            cmd = [APPTAINER, "build", *BUILD_OPTIONS, *bind, *args, str(tmp), str(recipe)]
            f.write(f"# cwd: {context}\n# {' '.join(cmd)}\n")
            f.flush()
            rc = subprocess.run(
                cmd, cwd=context, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        if rc != 0 or not tmp.is_file():
            raise ContainerError(
                f"apptainer build of {recipe} failed (exit {rc}); full log: {log}\n"
                f"--- last lines ---\n{_tail(log)}"
            )
        os.replace(tmp, image)
    except subprocess.TimeoutExpired as e:
        raise ContainerError(
            f"apptainer build of {recipe} timed out after {timeout_s} s; log: {log}"
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
