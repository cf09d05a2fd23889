"""Apptainer images: build one atomically, describe it, and prefix commands to run inside it."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, hashing
from ddppipe.core.errors import UserError

APPTAINER = "apptainer"
BUILD_OPTIONS = ("--fakeroot", "--force", "--mksquashfs-args", "-comp zstd -Xcompression-level 3")
IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH
WHEELHOUSE = "build/wheels"  # below the build context: torch's wheels, shared with the host
WHEELHOUSE_IN_IMAGE = "/opt/wheelhouse"


class ContainerError(RuntimeError, UserError):
    """An image could not be built or inspected; the message says which step and where to look."""


def enabled(cfg: dict[str, Any]) -> bool:
    return cfg.get("container", {}).get("mode", "none") == "apptainer"


def info_path(image: str | Path) -> Path:
    """The image-info JSON written next to an image: ``X.sif`` -> ``X.json``."""
    return Path(image).with_suffix(".json")


def gpus_present() -> bool:
    """Whether this host has NVIDIA GPUs that ``apptainer exec --nv`` could bind in."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def exec_prefix(cfg: dict[str, Any], gpus: bool | None = None) -> list[str]:
    """``apptainer exec [--nv] [exec_args] [--bind DIR ...] IMAGE``, or ``[]`` when off.

    ``--nv`` is added when ``gpus`` is true, or (``gpus=None``) when this host has GPUs; the
    binds are :func:`user_binds`; IMAGE is :func:`run_image`.
    """
    if not enabled(cfg):
        return []
    extra = list(cfg["container"].get("exec_args") or [])
    want_gpus = gpus_present() if gpus is None else gpus
    nv = ["--nv"] if want_gpus and "--nv" not in extra else []
    binds = [arg for folder in user_binds(cfg) for arg in ("--bind", folder)]
    return [APPTAINER, "exec", *nv, *extra, *binds, run_image(cfg)]


# -- the user's files inside the image ----------------------------------------------------------


def _user_files(cfg: dict[str, Any]) -> list[str]:
    """The user's code files the config names: ``task`` when it names a file (not a module),
    and ``script``."""
    from ddppipe.tasks import is_file_ref

    task = cfg.get("task") or ""
    files = [task] if is_file_ref(task) else []
    return files + ([cfg["script"]] if cfg.get("script") else [])


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


def user_binds(cfg: dict[str, Any], cwd: str | Path | None = None) -> list[str]:
    """Folders of the user's task file and torchrun script to bind at the same path.

    Paths are relative to ``cwd`` (the Snakemake working directory, default the current one).
    Apptainer binds the working directory by default, but not with ``--contain`` or
    ``--no-mount`` in exec_args nor below system paths, so they are bound explicitly. Left
    out: folders that do not exist (the loader then says which file is missing), folders
    inside another bound one, and those ``exec_args`` already bind at the same path.
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    covered = _bound(list(cfg.get("container", {}).get("exec_args") or []))
    files = [base / f for f in _user_files(cfg)]
    # as written and with symlinks resolved (where the task loader looks)
    wanted = {Path(os.path.abspath(f)).parent for f in files} | {f.resolve().parent for f in files}
    binds: list[Path] = []
    for folder in sorted(wanted):  # sorted: a folder before its subfolders
        if folder.is_dir() and not any(folder.is_relative_to(c) for c in covered + binds):
            binds.append(folder)
    return [str(f) for f in binds]


def python_command(cfg: dict[str, Any], gpus: bool | None = None) -> list[str]:
    """The Python to start training with: this interpreter, or the image's via exec_prefix."""
    prefix = exec_prefix(cfg, gpus)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]


def sha256(path: str | Path) -> str:
    """An image's (or recipe's) SHA-256."""
    return hashing.file_sha256(path)


def labels(image: str | Path) -> dict[str, str]:
    """The image's labels, from ``apptainer inspect --json --labels``."""
    cmd = [APPTAINER, "inspect", "--json", "--labels", str(image)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        stderr = getattr(e, "stderr", "") or ""
        raise ContainerError(f"`{' '.join(cmd)}` failed: {e}\n{stderr}") from e
    return json.loads(out)["data"]["attributes"]["labels"]


def image_info(image: str | Path, recipe: str | Path, path: str | Path | None = None) -> dict:
    """What the provenance records of an image: its path, SHA-256, recipe and labels."""
    return {
        "path": str(path or image),
        "sha256": sha256(image),
        "size_bytes": Path(image).stat().st_size,
        "recipe": str(recipe),
        "recipe_sha256": sha256(recipe),
        "labels": labels(image),
    }


def build_args(context: Path) -> list[str]:
    """``--build-arg`` options: ddppipe's version and the git commit of ``context``."""
    from ddppipe import __version__
    from ddppipe.core import system

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
    The wheelhouse (:func:`fill_wheelhouse`) is bound in at ``/opt/wheelhouse``.
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
    tmp = image.with_name(f".{image.name}.{os.getpid()}.building")
    try:
        with open(log, "w") as f:
            wheels = fill_wheelhouse(context, f)
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


# -- a task's own packages: an image derived from container.image -----------------------------


@functools.cache
def _requirement_pattern() -> re.Pattern[str]:
    """A pinned requirement (``name==version``): the schema's pattern, the one definition."""
    from ddppipe.spec import config

    node = config.schema()["properties"]["container"]["properties"]["requirements"]
    return re.compile(node["items"]["pattern"])


def requirements(cfg: dict[str, Any]) -> list[str]:
    """``container.requirements``, sorted, without duplicates; ContainerError if one is unpinned."""
    given = [str(r) for r in cfg.get("container", {}).get("requirements") or []]
    pinned = _requirement_pattern()
    loose = [r for r in given if not pinned.search(r)]
    if loose:
        hints = []
        for r in loose:
            name = re.split(r"[\s\[<>=!~;@(]", r.strip(), maxsplit=1)[0] or r
            hints.append(f"  {r!r}: write {name}==VERSION (`pip index versions {name}` lists them)")
        raise ContainerError(
            "container.requirements must be pinned as name==version: the task image is rebuilt "
            "only when the list changes, so an unpinned requirement would stay at whatever "
            "version the first build got.\n" + "\n".join(hints)
        )
    return sorted(set(given))


def requirements_hash(reqs: list[str]) -> str:
    """12 hex digits naming a derived image: SHA-256 of the sorted requirements."""
    return hashing.sha256("\n".join(sorted(set(reqs))).encode())[:12]


def derived_image(base: str | Path, reqs: list[str]) -> Path:
    """The image ``base`` plus ``reqs``, next to it: ``ddppipe.sif`` -> ``ddppipe-<hash>.sif``."""
    base = Path(base)
    return base.with_name(f"{base.stem}-{requirements_hash(reqs)}{base.suffix}")


def recipe_path(image: str | Path) -> Path:
    """The recipe written next to a derived image: ``X.sif`` -> ``X.def``."""
    return Path(image).with_suffix(".def")


def run_image(cfg: dict[str, Any]) -> str:
    """The image train and evaluate run in: container.image, or with container.requirements
    the image derived from it (:func:`derived_image`, rule build_task_image)."""
    base = str(cfg["container"]["image"])
    reqs = requirements(cfg)
    return str(derived_image(base, reqs)) if reqs else base


def _name(requirement: str) -> str:
    """The normalized (PEP 503) name of a pinned requirement: ``Foo_Bar[x]==1`` -> foo-bar."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[=]", requirement, maxsplit=1)[0]).lower()


def derived_recipe(base: str, reqs: list[str], base_sha256: str | None = None) -> str:
    """The Apptainer recipe of ``base`` (a path, relative to the build's folder) plus ``reqs``.

    %post pip-installs the requirements into the image's venv with the image's own packages
    as constraints, so torch, CUDA and NCCL stay the base image's; %labels record the list,
    each requirement's installed version and everything the layer added.
    """
    listed = "\n".join(reqs)
    names = " ".join(_name(r) for r in reqs)
    return f"""\
Bootstrap: localimage
From: {base}

# Written by ddppipe (rule build_task_image, `ddppipe build-task-image`) from the config's
# container.requirements: the ddppipe image above plus these pinned packages, installed into
# its venv. The image's own packages keep their versions (pip constraints). Paths are relative
# to this file's folder: build it from there.

%arguments
    CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

%files
    {{{{ CA_BUNDLE }}}} /opt/ddppipe-build/ca-certificates.crt

%post
    set -eu
    # As in containers/ddppipe.def: no host pip configuration, the host's CA bundle for PyPI.
    export PIP_CONFIG_FILE=/dev/null
    export PIP_CERT=/opt/ddppipe-build/ca-certificates.crt
    export PIP_NO_CACHE_DIR=1
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    export PIP_ROOT_USER_ACTION=ignore
    export PIP_DEFAULT_TIMEOUT=180
    cd /opt/ddppipe-build
    cat > requirements.txt <<'EOF'
{listed}
EOF
    /opt/venv/bin/pip list --format=freeze > base.txt
    if ! /opt/venv/bin/pip install --constraint base.txt --requirement requirements.txt; then
        echo "ddppipe: container.requirements conflict with the image's own packages" \\
            "(base.txt: kept at these versions); choose versions compatible with them" >&2
        exit 1
    fi
    /opt/venv/bin/pip check
    /opt/venv/bin/pip list --format=freeze > after.txt
    /opt/venv/bin/python - {names} >> "$APPTAINER_LABELS" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

before = set(Path("base.txt").read_text().split())
added = sorted(set(Path("after.txt").read_text().split()) - before)
print("ddppipe.requirements.installed", " ".join(added))
for name in sys.argv[1:]:
    print(f"ddppipe.requirement.{{name}}.version", importlib.metadata.version(name))
EOF
    cd /
    rm -rf /opt/ddppipe-build /root/.cache

%labels
    ddppipe.requirements {" ".join(reqs)}
    ddppipe.base.sha256 {base_sha256 or "unknown"}
"""


def build_task_image(
    base: str | Path, reqs: list[str], image: str | Path, log: str | Path, timeout_s: float = 3600
) -> dict[str, Any]:
    """Build ``image`` = ``base`` + the pinned ``reqs`` atomically (:func:`build`); its info.

    The recipe is written next to ``image`` (``.def``). The info is :func:`image_info` plus
    the requirements and the base image's path, SHA-256 and recipe (from its info JSON).
    """
    reqs = requirements({"container": {"requirements": reqs}})
    if not reqs:
        raise ContainerError("no requirements to add: train in the base image itself")
    base, image = Path(base), Path(image)
    if not base.is_file():
        raise ContainerError(f"base image {base} not found: build it first (rule build_image)")
    found = info_path(base)
    base_info = json.loads(found.read_text()) if found.is_file() else {"sha256": sha256(base)}
    recipe = recipe_path(image)
    recipe.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(base.resolve(), recipe.parent.resolve())
    atomic.write_text(recipe, derived_recipe(relative, reqs, base_info.get("sha256")))
    build(recipe, image, log, context=recipe.parent, timeout_s=timeout_s, arguments=[])
    keys = ("sha256", "recipe", "recipe_sha256")
    return {
        **image_info(image, recipe),
        "requirements": reqs,
        "base": {"path": str(base), **{k: base_info.get(k) for k in keys}},
    }


# -- GPU runs need a CUDA image ----------------------------------------------------------------


def recipe_labels(recipe: str | Path) -> dict[str, str]:
    """The static ``%labels`` of a recipe (``name value`` lines)."""
    found: dict[str, str] = {}
    section = ""
    for line in Path(recipe).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            section = stripped.split()[0]
        elif section == "%labels" and stripped and not stripped.startswith("#"):
            name, _, value = stripped.partition(" ")
            found[name] = value.strip()
    return found


def cpu_only(recipe: Path, info: Path) -> str | None:
    """Why the image (built, or else to be built from ``recipe``) has no CUDA; None if it has.

    A built image answers with its labels (``ddppipe.cuda.version``, written at build time),
    if it was built from this recipe; a recipe not built yet with its ``ddppipe.variant``.
    """
    if info.is_file() and recipe.is_file():
        built = json.loads(info.read_text())
        if built.get("recipe_sha256") == sha256(recipe):
            labels = built.get("labels", {})
            if labels.get("ddppipe.cuda.version") in (None, "", "None"):
                torch = labels.get("ddppipe.torch.version", "?")
                return f"the image {built.get('path')} has a CPU-only torch ({torch})"
            return None
    if recipe.is_file():
        variant = recipe_labels(recipe).get("ddppipe.variant", "")
        if "cpu" in variant.lower():
            return f"the recipe {recipe} builds a CPU-only image (ddppipe.variant {variant})"
    return None


def check_gpu_image(cfg: dict[str, Any], recipe: str | Path, image: str | Path) -> None:
    """Raise ContainerError when a GPU run would train in an image without CUDA."""
    from ddppipe.spec.config import gpus_requested

    if not enabled(cfg) or not gpus_requested(cfg):
        return
    reason = cpu_only(Path(recipe), info_path(image))
    if reason:
        raise ContainerError(
            f"GPUs are requested (launch.device: gpu) but {reason}: every rank would stop. "
            "Set container.recipe: containers/ddppipe.def (CUDA + NCCL), or train on CPUs "
            "(launch.device: cpu)"
        )
