"""The training device of a rank: whether it must be a GPU, which one, and why it cannot be.

Everything here answers from what the process itself sees (inside the image when there is
one): ``CUDA_VISIBLE_DEVICES``, torch's device count and CUDA build, the node's driver. The
same functions serve the trainer and its node's checks (:mod:`ddppipe.parallel.node_check`,
also ``ddppipe preflight``'s), so the checks are what training will use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ddppipe.core.errors import UserError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

Use = Literal["gpu", "cpu"]  # the device a run trains on, as its spec records it
BF16_CAPABILITY = (8, 0)  # Ampere and newer compute bfloat16 natively; older GPUs emulate it
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
HIDDEN = ("", "-1", "NoDevFiles", "none")  # CUDA_VISIBLE_DEVICES values that hide every GPU


class DeviceError(RuntimeError, UserError):
    """A rank cannot use the device its run needs; the message says what it sees and what to do."""


def trains_on_gpus(
    cfg: dict[str, Any], slurm: bool, recipe: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:  # fmt: skip
    """Whether the run will train on GPUs, one per process: the one place ``launch.device`` is
    decided, once per run, where it is submitted (the workflow's :class:`Runs`, or
    ``ddppipe resolve-config`` by hand), and recorded in its spec
    (:mod:`ddppipe.settings.run_spec`: ``resolved.device``), which everything after reads (its
    recipe too: :mod:`ddppipe.settings.presets`).

    ``launch.device`` ``gpu`` or ``cpu`` says it. ``auto``: CPUs in a SLURM job (``slurm``: the
    SLURM executor runs the training; or this process runs in a job): GPUs the ranks might
    see there belong to other jobs. Otherwise this machine's GPUs, as torch sees them; with
    ``container.mode: apptainer``, as ``apptainer exec --nv`` binds them in, and only when the
    image has CUDA (judged on ``recipe``, the base image's recipe, and the built image's
    labels): a CPU-only image trains on CPUs.
    """
    env = os.environ if env is None else env
    if cfg["launch"]["device"] != "auto":
        return cfg["launch"]["device"] == "gpu"
    if slurm or env.get("SLURM_JOB_ID"):
        return False
    from ddppipe.apptainer import gpu_check, identity, running, tool
    from ddppipe.settings import run_spec

    if not running.gpus_present():
        return False  # no NVIDIA driver here: torch (1.5 s) need not say
    if tool.enabled(run_spec.section(run_spec.Container, cfg["container"])):
        recipe = Path(recipe if recipe is not None else cfg["container"]["recipe"])
        image = identity.info_path(cfg["container"]["image"])
        return gpu_check.cpu_only(recipe, image) is None
    import torch

    return bool(torch.version.cuda) and torch.cuda.is_available()


def synchronize(device: Any) -> None:
    """Wait for the work queued on ``device`` (a GPU's stream); nothing to wait for on a CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_index(local_rank: int, visible: int, local_world_size: int | None) -> int:
    """The CUDA index a rank trains on, among the ``visible`` devices it sees.

    A rank that sees at least as many devices as its node runs processes sees them all and
    takes the one of its local rank. A rank that sees fewer (``srun --gpus-per-task``,
    ``--gpu-bind``, per-task device cgroups, a MIG slice) sees its own: the first.
    """
    if visible < 1:
        raise ValueError("no visible device")
    if local_world_size is None:
        return local_rank if local_rank < visible else 0
    return local_rank if visible >= local_world_size else 0


def node_devices(device: int, visible: int, local_world_size: int) -> list[int]:
    """The CUDA indices, as this rank sees them, that its node's ranks train on: every local
    rank's where it sees them all (:func:`device_index`), else only its own."""
    return list(range(local_world_size)) if visible >= local_world_size else [device]


def driver_version() -> str | None:
    """The node's NVIDIA kernel driver version (``/proc/driver/nvidia/version``), if loaded."""
    try:
        text = DRIVER_VERSION_FILE.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown version"


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cuda_init_error() -> str | None:
    import torch

    try:
        torch.cuda.init()
    except Exception as e:  # any reason CUDA would not start is the answer
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


@dataclass(frozen=True)
class Seen:
    """What a process sees of the GPUs."""

    host: str
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES, None when unset
    count: int
    torch: str
    cuda_build: str | None  # torch.version.cuda; None: a CPU-only build of torch
    driver: str | None  # None: no NVIDIA driver loaded on the node
    libcuda: bool
    init_error: str | None
    container: str | None  # the Apptainer image this runs in, if any

    @classmethod
    def here(cls, env: Mapping[str, str] | None = None) -> Seen:
        import torch

        env = os.environ if env is None else env
        count = torch.cuda.device_count() if torch.version.cuda else 0
        return cls(
            host=socket.gethostname(),
            visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            count=count,
            torch=str(torch.__version__),
            cuda_build=torch.version.cuda,
            driver=driver_version(),
            libcuda=_libcuda_loads(),
            init_error=None if count or not torch.version.cuda else _cuda_init_error(),
            container=env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER"),
        )

    def describe(self) -> str:
        visible = "unset" if self.visible_devices is None else repr(self.visible_devices)
        build = f"CUDA {self.cuda_build}" if self.cuda_build else "a CPU-only build"
        driver = self.driver or "none loaded"
        where = f" in {self.container}" if self.container else ""
        return (
            f"CUDA_VISIBLE_DEVICES={visible}, {self.count} CUDA device(s), torch {self.torch} "
            f"({build}){where}, NVIDIA driver: {driver}"
        )

    def advice(self) -> str:
        """What to do about seeing no GPU, from the most to the least likely cause."""
        if not self.cuda_build:
            return (
                "this torch is a CPU-only build: train in the CUDA image (container.mode: "
                "apptainer, container.recipe: containers/ddppipe.def) or install torch's CUDA "
                "build"
            )
        if self.visible_devices is not None and self.visible_devices.strip() in HIDDEN:
            return (
                "CUDA_VISIBLE_DEVICES hides every GPU from this process: ask SLURM for GPUs "
                "(launch.device: gpu) and do not clear CUDA_VISIBLE_DEVICES"
            )
        if self.driver is None:
            return (
                "no NVIDIA driver is loaded on this node: run on GPU nodes (slurm.partition / "
                "slurm.constraint), or train on CPUs with launch.device: cpu"
            )
        if self.container and not self.libcuda:
            return (
                f"the node has NVIDIA driver {self.driver} but its libraries are not in the "
                "container: run `apptainer exec --nv` (ddppipe adds --nv when "
                "launch.device: gpu)"
            )
        if self.init_error and "too old" in self.init_error:
            return (
                f"NVIDIA driver {self.driver} is older than CUDA {self.cuda_build} (this torch) "
                "needs: update the driver, or use an image whose torch is built for an older "
                f"CUDA ({self.init_error})"
            )
        detail = f" ({self.init_error})" if self.init_error else ""
        return f"CUDA does not start{detail}: check `nvidia-smi` on this node"


def no_gpu_error(seen: Seen, why: str) -> DeviceError:
    return DeviceError(f"{seen.host}: {why}; it sees {seen.describe()}. Fix: {seen.advice()}")


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")  # sm_90, sm_100, sm_90a, sm_100f


def _arch_supported(capability: tuple[int, int], archs: list[str]) -> bool:
    """Whether torch's kernels (``sm_XY`` binaries, ``compute_XY`` PTX) run on ``capability``:
    ``sm_XY`` on X.Y and later minors of X, ``compute_XY`` on X.Y and later; the
    architecture-specific ``sm_XYa`` only on X.Y, the family-specific ``sm_XYf`` on X.Y and
    later minors of X. Names of another form are skipped."""
    for arch in archs:
        found = _ARCH.fullmatch(arch)
        if found is None:
            continue
        kind, major, minor, variant = found.groups()
        arch_cap = (int(major), int(minor))
        if variant == "a" or (kind == "compute" and variant):
            runs = arch_cap == capability
        elif kind == "sm":
            runs = arch_cap[0] == capability[0] and arch_cap[1] <= capability[1]
        else:
            runs = arch_cap <= capability
        if runs:
            return True
    return False


def speed_up_cuda() -> None:
    """Let cuDNN pick the fastest convolution algorithms and fp32 matmuls use TF32 (the
    training's settings; the preflight's GEMM peak is measured under them too)."""
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def check_gpu(index: int, precision: str) -> str:
    """Raise DeviceError unless this torch runs on GPU ``index`` at ``precision``; describe it."""
    import torch

    name = torch.cuda.get_device_name(index)
    capability = torch.cuda.get_device_capability(index)
    cc = f"{capability[0]}.{capability[1]}"
    archs = torch.cuda.get_arch_list()
    if archs and not _arch_supported(capability, archs):
        raise DeviceError(
            f"{socket.gethostname()}: GPU {index} ({name}, compute capability {cc}) is not "
            f"supported by torch {torch.__version__} (CUDA {torch.version.cuda}, kernels for "
            f"{' '.join(archs)}): use an image whose torch is built for it"
        )
    check_precision(name, capability, precision)
    return f"{name} (compute capability {cc})"


def check_precision(name: str, capability: tuple[int, int], precision: str) -> None:
    """bf16 only where the GPU computes it natively (compute capability >= 8.0)."""
    if precision == "bf16" and capability < BF16_CAPABILITY:
        raise DeviceError(
            f"{socket.gethostname()}: train.precision is bf16 but {name} (compute capability "
            f"{capability[0]}.{capability[1]}) only emulates bfloat16, slower than fp32; "
            "bf16 needs compute capability 8.0 or newer (A100, H100, L40, RTX 30xx and later). "
            "Set train.precision: fp32"
        )


def select(local_rank: int, local_world_size: int | None, wanted: Use) -> torch.device:
    """The device this rank trains on; DeviceError when a GPU is required and unusable."""
    import torch

    if wanted == "cpu":
        return torch.device("cpu")
    seen_count = torch.cuda.device_count() if torch.version.cuda else 0
    if seen_count == 0 or not torch.cuda.is_available():
        raise no_gpu_error(Seen.here(), f"local rank {local_rank} needs a GPU and has none")
    return torch.device("cuda", device_index(local_rank, seen_count, local_world_size))


def node_check(nproc: int, wanted: Use, precision: str) -> str:
    """One line on this node's devices for ``nproc`` training processes; DeviceError if unfit.

    (A CPU run does not import torch here: the preflight's node check stays quick.)
    """
    cpus = f"{nproc} process(es) on CPUs ({len(os.sched_getaffinity(0))} usable)"
    if wanted == "cpu":
        return f"{socket.gethostname()}: {cpus}"
    import torch

    seen = Seen.here()
    if seen.count == 0 or not torch.cuda.is_available():
        raise no_gpu_error(seen, f"{nproc} process(es) need a GPU each and none is usable")
    if seen.count < nproc:
        raise no_gpu_error(seen, f"{nproc} processes need a GPU each but {seen.count} are visible")
    gpus = [check_gpu(i, precision) for i in range(nproc)]
    return f"{seen.host}: {', '.join(gpus)}; driver {seen.driver}, CUDA {seen.cuda_build}"


def info() -> dict[str, Any]:
    """GPU models and driver of this process (for provenance); empty without a GPU."""
    import torch

    if not torch.version.cuda or not torch.cuda.is_available():
        return {}
    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "driver": driver_version(),
    }
