"""Apptainer images: build one atomically, describe it, and prefix commands to run inside it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddppipe.errors import UserError

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
    """``apptainer exec [--nv] [exec_args] IMAGE``, or ``[]`` when containers are off.

    ``--nv`` is added when ``gpus`` is true, or (``gpus=None``) when this host has GPUs.
    """
    if not enabled(cfg):
        return []
    c = cfg["container"]
    extra = list(c.get("exec_args") or [])
    want_gpus = gpus_present() if gpus is None else gpus
    nv = ["--nv"] if want_gpus and "--nv" not in extra else []
    return [APPTAINER, "exec", *nv, *extra, str(c["image"])]


def python_command(cfg: dict[str, Any], gpus: bool | None = None) -> list[str]:
    """The Python to start training with: this interpreter, or the image's via exec_prefix."""
    prefix = exec_prefix(cfg, gpus)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    from ddppipe import __version__, provenance

    git = provenance.git_commit(context)
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


def build(recipe: Path, image: Path, log: Path, context: Path, timeout_s: float = 3600) -> None:
    """``apptainer build`` ``recipe`` into ``image``, atomically, run in ``context``.

    The recipe's %files paths are relative to ``context`` (the repository root). The image
    is built into a temporary file next to ``image`` and renamed only on success, so a
    failed build never leaves a half-written image where the next step would use it.
    The wheelhouse (:func:`fill_wheelhouse`) is bound in at ``/opt/wheelhouse``.
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
            cmd = [APPTAINER, "build", *BUILD_OPTIONS, *bind, *build_args(context), str(tmp),
                   str(recipe)]  # fmt: skip
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
    from ddppipe.config import gpus_requested

    if not enabled(cfg) or not gpus_requested(cfg):
        return
    reason = cpu_only(Path(recipe), info_path(image))
    if reason:
        raise ContainerError(
            f"GPUs are requested (slurm.gpus_per_node: {cfg['slurm']['gpus_per_node']}, "
            f"launch.backend: {cfg['launch']['backend']}) but {reason}: every rank would stop. "
            "Set container.recipe: containers/ddppipe.def (CUDA + NCCL), or train on CPUs "
            "(slurm.gpus_per_node: 0, launch.backend: auto)"
        )
