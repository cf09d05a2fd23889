"""Finding and loading a task: its source without importing it (:func:`locate`, no torch), the
module with the contract's functions (:func:`load`), its ``task_args`` checked against its
``ARGS_SCHEMA`` and its model built once (:func:`validate_args`, :func:`check_model`) or its
parameters counted (:func:`parameter_count`); a failure of any of them a :class:`TaskError`
naming the task, the step and, for a missing package, where to install it. The contract
itself: :mod:`ddppipe.tasks`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ddppipe.core import hashing
from ddppipe.core.errors import UserError

REQUIRED = ("prepare", "datasets", "model")
# Modules of ddppipe that task files imported before the packages by concern: where they are.
MOVED_MODULES = {
    "ddppipe.model": "ddppipe.model is now ddppipe.tasks.model (from ddppipe.tasks.model import "
    "Net); rename the import",
}
OPTIONAL = ("loss", "metrics", "optimizer", "ARGS_SCHEMA")
# A task's task_args key naming the folder of files its datasets() read (data.pack packs it).
FOLDER_ARG = "FOLDER_ARG"


class TaskError(RuntimeError, UserError):
    """A task could not be loaded or one of its functions failed; the message names both."""


def is_file_ref(ref: str) -> bool:
    """Whether ``ref`` names a Python file (``tasks/cifar.py``) rather than a module."""
    return ref.endswith(".py") or "/" in ref


def _distribution_version(module_name: str) -> str | None:
    """The version of the installed distribution providing ``module_name``'s package."""
    top = module_name.split(".")[0]
    # Usually named as its package (ddppipe): one lookup. Otherwise the mapping of every
    # installed distribution's files, 0.4-0.6 s with torch's 30,000 (Snakemake's start,
    # write_config and every training process locate the task).
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution(top)
        if top in (dist.read_text("top_level.txt") or "").split():
            return dist.version
    for dist in importlib.metadata.packages_distributions().get(top, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Source:
    """Where a task comes from: its identity in the run's config and provenance."""

    ref: str  # as configured
    name: str  # short name: the file's stem or the module's last component
    path: str  # absolute path of its source file
    sha256: str  # of that file: a changed task file is a changed run
    version: str | None  # of the installed distribution providing it, if any

    def as_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "name": self.name, "path": self.path, "sha256": self.sha256,
                "version": self.version}  # fmt: skip


def locate(ref: str, cwd: Path | None = None) -> Source:
    """The source of task ``ref`` without importing it (no torch); raise TaskError."""
    if is_file_ref(ref):
        return _file_source(ref, cwd, "task", "`task:` names a Python file relative to the "
                            "working directory, or an importable module such as "
                            "ddppipe.tasks.mnist")  # fmt: skip
    try:
        spec = importlib.util.find_spec(ref)
    except (ImportError, ValueError) as e:
        spec, error = None, f" ({type(e).__name__}: {e})"
    else:
        error = ""
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise TaskError(
            f"task {ref!r}: no importable module of that name{error}; install its package "
            "in the environment (and the image), or name its file: task: path/to/task.py"
        )
    path = Path(spec.origin).resolve()
    return Source(ref, ref.rsplit(".", 1)[-1], str(path), hashing.file_sha256(path),
                  _distribution_version(ref))  # fmt: skip


def _image() -> str | None:
    """The Apptainer image this process runs in, if any (Apptainer sets the variable)."""
    return os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")


def where_this_runs() -> str:
    """Where this process runs, in words: the image, or this machine's Python environment."""
    image = _image()
    return f"the image {image}" if image else f"this machine's Python environment ({sys.prefix})"


def _missing_package(e: BaseException, source: Source) -> str | None:
    """The top-level package whose absence a ModuleNotFoundError reports; none when it is
    installed (a module of it is missing) or is a file next to the task's."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".")[0]
    folder = Path(source.path).parent
    if (folder / f"{top}.py").exists() or (folder / top).is_dir():
        return None
    try:
        return None if importlib.util.find_spec(top) is not None else top
    except (ImportError, ValueError):
        return top


def missing_package_error(source: Source, step: str | None, package: str) -> TaskError:
    """A task imports a package that is not installed where the step runs: the error names
    the package, the step, where it ran, and both ways to fix it."""
    if _image() is None:
        pinned = f"requirements: [{package}==VERSION]"
        image = f"run it in an image with it, container: {{mode: apptainer, {pinned}}}"
        here = f"install it where this step runs: {sys.executable} -m pip install {package}"
    else:
        image = f"add it to this image, container.requirements: [{package}==VERSION]"
        here = "install it where this step runs: in the image's recipe (container.recipe)"
    return TaskError(
        f"{step or 'this step'}: task {source.ref} ({source.path}) imports {package}, which is "
        f"not installed in {where_this_runs()}. Either {image} (`pip index versions {package}` "
        f"lists the versions; a module's pip package may have another name), or {here}"
    )


@dataclass(frozen=True)
class Task:
    """A loaded task: its module, where it came from, and the contract's functions."""

    source: Source
    module: ModuleType
    step: str | None = None  # the step that loaded it (a rule, a command), for its errors

    @property
    def name(self) -> str:
        return self.source.name

    def has(self, hook: str) -> bool:
        return callable(getattr(self.module, hook, None))

    def call(self, function: str, *args: Any) -> Any:
        """``module.function(*args)``; any exception becomes a TaskError naming both."""
        try:
            return getattr(self.module, function)(*args)
        except UserError:
            raise
        except Exception as e:
            package = _missing_package(e, self.source)  # an import inside the function
            if package:
                raise missing_package_error(self.source, self.step, package) from e
            raise TaskError(
                f"task {self.source.ref} ({self.source.path}): {function}() raised "
                f"{type(e).__name__}: {e}"
            ) from e

    @property
    def args_schema(self) -> dict[str, Any] | None:
        return getattr(self.module, "ARGS_SCHEMA", None)

    def folder_arg(self, step: str) -> str:
        """The ``task_args`` key naming the folder the task's ``datasets`` read (its
        ``FOLDER_ARG``), which ``step`` packs; raise TaskError where it declares none."""
        name = getattr(self.module, FOLDER_ARG, None)
        if not isinstance(name, str):
            raise TaskError(
                f"{step}: task {self.source.ref} declares no folder of its data ({FOLDER_ARG} "
                f'= "root": the task_args key naming it, as ddppipe.tasks.imagefolder has): '
                "declare it, or set data.pack: none"
            )
        return name


def load(ref: str, cwd: Path | None = None, step: str | None = None) -> Task:
    """Import task ``ref`` and check it provides the contract's functions; raise TaskError.

    ``step`` (e.g. ``prepare_data (ddppipe prepare)``) is named in the error of a module the
    task imports but this environment lacks.
    """
    source = locate(ref, cwd)
    module_name = f"ddppipe_user_task_{source.name}" if is_file_ref(ref) else ref
    try:
        if is_file_ref(ref):
            spec = importlib.util.spec_from_file_location(module_name, source.path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ref)
    except Exception as e:
        sys.modules.pop(module_name, None) if is_file_ref(ref) else None
        moved = MOVED_MODULES.get(getattr(e, "name", None) or "")
        package = None if moved else _missing_package(e, source)
        if package:
            raise missing_package_error(source, step, package) from e
        raise TaskError(
            f"task {ref} ({source.path}): importing it raised {type(e).__name__}: {e}"
            + (f"; {moved}" if moved else "")
        ) from e
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise TaskError(
            f"task {ref} ({source.path}) lacks {', '.join(f'{m}()' for m in missing)}: a task "
            "provides prepare(data_dir, args), datasets(data_dir, args) and model(args) "
            "(README, 'Your own model')"
        )
    return Task(source, module, step)


def locate_script(ref: str, cwd: Path | None = None) -> Source:
    """The source of a ``script:`` (a torchrun script file); raise TaskError."""
    return _file_source(ref, cwd, "script", "`script:` names a torchrun script relative to "
                        "the working directory")  # fmt: skip


def _file_source(ref: str, cwd: Path | None, what: str, hint: str) -> Source:
    """The source of file ``ref`` (relative to ``cwd``), or a TaskError with ``hint``."""
    path = (Path(cwd or Path.cwd()) / ref).resolve()
    if not path.is_file():
        raise TaskError(f"{what} {ref!r}: no such file ({path}); {hint}")
    return Source(ref, path.stem, str(path), hashing.file_sha256(path), None)


def validate_args(task: Task, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` coerced, checked against the task's ARGS_SCHEMA and filled with its defaults."""
    from ddppipe.settings import config
    from ddppipe.tasks import prepare_args

    schema = task.args_schema
    try:
        prepare_args.check(task.module, schema)
    except prepare_args.PrepareArgsError as e:
        raise TaskError(f"task {task.source.ref}: {e}") from None
    if schema is None:
        return dict(args)
    try:
        return copy.deepcopy(config.validate_against(copy.deepcopy(args), schema, "task_args"))
    except config.ConfigError as e:
        hint = (
            "\ntask_args belong to the task: after changing task:, give the new task its own "
            "(a config file of its own, or --configfile; README, 'Your own model')"
        )
        where = f"task {task.source.ref} ({task.source.path})"
        raise config.ConfigError(f"{where}: {e}{hint}") from None


def check_model(task: Task, args: dict[str, Any]) -> str:
    """Build the task's model once (on the submitting side: a broken task fails here, not in
    an allocation); a line describing it."""
    import torch

    net = task.call("model", args)
    if not isinstance(net, torch.nn.Module):
        raise TaskError(
            f"task {task.source.ref} ({task.source.path}): model() returned "
            f"{type(net).__name__}, not a torch.nn.Module"
        )
    params = sum(p.numel() for p in net.parameters())
    return f"task {task.source.ref}: {type(net).__name__} with {params:,} parameters"


def parameter_count(task: Task, args: dict[str, Any]) -> int:
    """The parameters of the task's model, built on the meta device: no memory, no
    initialisation (a 1.3B-parameter model in a fraction of a second); raise TaskError for a
    model that cannot be built there (one that loads its weights, say)."""
    import torch

    with torch.device("meta"):
        net = task.call("model", args)
    if not isinstance(net, torch.nn.Module):
        raise TaskError(f"task {task.source.ref}: model() returned {type(net).__name__}")
    return sum(p.numel() for p in net.parameters())
