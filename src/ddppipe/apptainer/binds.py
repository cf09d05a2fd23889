"""The user's files inside the image: the folders of the task file and script to bind in; the
options of a bind (:func:`bind_args`)."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from ddppipe.settings.run_spec import RunSpec


def bind_args(
    source: str | Path, target: str | Path | None = None, options: tuple[str, ...] = ()
) -> list[str]:
    """``apptainer exec`` options binding the host path ``source`` at ``target`` (None: at its
    own path) with ``options`` (``ro``, ``image-src=/``): ``--bind SRC[:DST[:OPTS]]``; where a
    path holds a comma or a colon (``--bind``'s separators, which it cannot escape),
    ``--mount`` with its fields quoted as CSV instead (Apptainer 1.1 and later)."""
    source = str(source)
    if target is None and not options and not any(c in source for c in ",:"):
        return ["--bind", source]
    target = source if target is None else str(target)
    if not any(c in source + target for c in ",:"):
        return ["--bind", ":".join([source, target, *([",".join(options)] if options else [])])]
    text = io.StringIO()
    csv.writer(text, lineterminator="").writerow(
        ["type=bind", f"src={source}", f"dst={target}", *options]
    )
    return ["--mount", text.getvalue()]


def _user_files(spec: RunSpec) -> list[str]:
    """The user's code files the run names: ``task`` when it names a file (not a module),
    and ``script``."""
    from ddppipe.tasks import is_file_ref

    files = [spec.task] if is_file_ref(spec.task) else []
    return files + ([spec.script] if spec.script else [])


def _bound(exec_args: list[str]) -> list[Path]:
    """The host folders ``exec_args`` already bind at the same path (``--bind``/``-B`` specs
    ``SRC``, ``SRC:SRC[:OPTS]``, comma-separated)."""
    specs = []
    for i, arg in enumerate(exec_args):
        if arg in ("--bind", "-B") and i + 1 < len(exec_args):
            specs.append(exec_args[i + 1])
        elif arg.startswith(("--bind=", "-B=")):
            specs.append(arg.split("=", 1)[1])
    found = []
    for one in (s for spec in specs for s in spec.split(",") if s):
        src, _, rest = one.partition(":")
        dest = rest.split(":")[0] if rest else src
        if dest == src:
            found.append(Path(os.path.abspath(src)))
    return found


def user_binds(spec: RunSpec, cwd: str | Path | None = None) -> list[str]:
    """Folders of the user's task file and torchrun script to bind at the same path.

    Paths are relative to ``cwd`` (the Snakemake working directory, default the current one).
    Apptainer binds the working directory by default, but not with ``--contain`` or
    ``--no-mount`` in exec_args nor below system paths, so they are bound explicitly. Left
    out: folders that do not exist (the loader then says which file is missing), folders
    inside another bound one, and those ``exec_args`` already bind at the same path.
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    covered = _bound(list(spec.container.exec_args))
    files = [base / f for f in _user_files(spec)]
    # as written and with symlinks resolved (where the task loader looks)
    wanted = {Path(os.path.abspath(f)).parent for f in files} | {f.resolve().parent for f in files}
    binds: list[Path] = []
    for folder in sorted(wanted):  # sorted: a folder before its subfolders
        if folder.is_dir() and not any(folder.is_relative_to(c) for c in covered + binds):
            binds.append(folder)
    return [str(f) for f in binds]
