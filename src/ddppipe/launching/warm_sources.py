"""What a warm server imported, as it was on disk: a server kept between calls
(:mod:`ddppipe.launching.warm`) whose code changed since it imported it is stale, and the
next call starts a fresh one instead of forking the old code.

A module of an installed package is represented by its package folder (``site-packages``:
``pip`` adds or removes a package's ``dist-info`` there, which changes the folder), any other
module (ddppipe's own in an editable install, a task's file, a module a task imports) by its
file; the standard library only through the interpreter.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

Signature = tuple[int, int]  # (st_mtime_ns, st_size)


def _signature(path: str) -> Signature | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _installed() -> tuple[str, ...]:
    """The folders of installed packages (their own changes tell what changed in them)."""
    paths = sysconfig.get_paths()
    found = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        found.add(site.getusersitepackages())
    return tuple(sorted(str(Path(p)) + os.sep for p in found))


def _standard() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({str(Path(paths["stdlib"])) + os.sep,
                         str(Path(paths["platstdlib"])) + os.sep}))  # fmt: skip


def snapshot(known: dict[str, Signature]) -> dict[str, Signature]:
    """``known`` with the sources of the modules imported since added, as they are now: the
    interpreter, each package folder a module came from, each other module's file."""
    found = dict(known)
    installed, standard = _installed(), _standard()
    found.setdefault(sys.executable, _signature(sys.executable) or (0, 0))  # (a venv's link)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)  # (torch.ops's is "_ops.py": no file)
        if not isinstance(file, str) or not os.path.isabs(file) or file in found:
            continue
        folder = next((f for f in installed if file.startswith(f)), None)
        source = folder if folder is not None else None if file.startswith(standard) else file
        if source is not None and source not in found:
            signature = _signature(source)
            if signature is not None:
                found[source] = signature
    return found


def changed(known: dict[str, Signature]) -> str | None:
    """The first source of ``known`` that changed on disk (or went away); None: none did."""
    for path, signature in known.items():
        if _signature(path) != signature:
            return path
    return None
