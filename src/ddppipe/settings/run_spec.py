"""The run spec: a resolved config as frozen dataclasses, validated once per process.

:func:`resolve` turns a user's config into a spec where the run is submitted (validation,
the preset, the device decision); the workflow writes it to ``results/<run>/config.yaml``
(``ddppipe resolve-config``). Every process of a slot reads that file once with :func:`load`
and hands the spec on: the launcher, the SLURM request, the preflight, the life cycle and the
ranks never validate again nor derive the device a second time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from ddppipe.settings import config, layout

Device = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class Train:
    """``train:``, every recipe key filled in by the preset."""

    preset: str
    epochs: int
    batch_size: int  # the global batch
    optimizer: str
    lr: float
    weight_decay: float
    schedule: str
    gamma: float
    precision: str
    channels_last: bool
    label_smoothing: float
    seed: int
    eval_batch_size: int
    checkpoint_every: int
    keep_checkpoints: int
    activation_checkpointing: bool = False  # recompute the blocks' activations (parallel.fsdp)
    deterministic: bool = False  # deterministic kernels (ddppipe.training.loop.determinism)
    checkpoint_minutes: float | None = None  # also mid-epoch, by time (training.loop.save_clock)
    # auto | on | off: the step as a CUDA graph (ddppipe.training.loop.graphs)
    cuda_graphs: str = "auto"

    def __post_init__(self) -> None:
        # (YAML reads an unquoted on/off as a boolean: the schema admits both spellings)
        if isinstance(self.cuda_graphs, bool):
            object.__setattr__(self, "cuda_graphs", "on" if self.cuda_graphs else "off")


@dataclass(frozen=True)
class Launch:
    """``launch:``: the processes of the run."""

    nnodes: int
    nproc_per_node: int
    device: str  # as configured: auto, cpu or gpu (RunSpec.device is the decision)
    max_restarts: int
    cpus_per_proc: int | None
    hang_timeout_s: float | str  # seconds, or "auto" (ddppipe.launching.watchdog)
    strategy: str = "ddp"  # ddp | fsdp | hsdp (ddppipe.parallel.fsdp)
    loader_workers: int | None = None  # None: chosen for the task's data (ddppipe.data.batches)
    stage_data: str | None = None  # a node-local folder (ddppipe.data.staging); None: not staged


@dataclass(frozen=True)
class Data:
    """``data:``: how the task's data is stored (:mod:`ddppipe.data.squashfs`)."""

    pack: str = "none"  # none | squashfs


@dataclass(frozen=True)
class Slurm:
    """``slurm:``: the training job's SLURM options."""

    mem_mb: int | None
    runtime: int
    partition: str | None
    account: str | None
    constraint: str | None
    qos: str | None
    signal_seconds: int
    stop_signal: str
    rendezvous_host: str | None
    max_continuations: int
    max_excluded_nodes: int
    cluster_check: str
    spare_nodes: int = 0  # nodes held beyond launch.nnodes for a node failure (--no-kill)
    min_nodes: int | None = None  # fewest nodes to go on with in the job; None: launch.nnodes


@dataclass(frozen=True)
class Container:
    """``container:``: the image the run trains in, if any."""

    mode: str
    recipe: str
    image: str
    exec_args: tuple[str, ...]
    requirements: tuple[str, ...]


@dataclass(frozen=True)
class Tracking:
    """``tracking:``: rank 0's TensorBoard, MLflow and Weights & Biases."""

    tensorboard: bool
    mlflow: str | None
    wandb: Mapping[str, Any] | None = None  # {project, entity, mode}; None: no W&B


@dataclass(frozen=True)
class Scaling:
    """``scaling:``: the scaling study's grid."""

    nodes: tuple[int, ...]
    procs_per_node: tuple[int, ...]
    cpus_per_proc: tuple[int, ...]
    epochs: int | None
    accuracy_targets: tuple[float, ...]


@dataclass(frozen=True)
class Pack:
    """``sweep.pack``: the held allocations a packed sweep's trials train in."""

    allocations: int
    nodes: int
    trials_per_node: int
    time_min: int

    @property
    def slots(self) -> int:
        """Trials training at once in one allocation."""
        return self.nodes * self.trials_per_node


@dataclass(frozen=True)
class SweepSection:
    """``sweep:`` as written (:mod:`ddppipe.settings.sweep` checks it and derives the trials)."""

    name: str | None
    parameters: Mapping[str, Any]
    method: str
    trials: int
    seed: int
    metric: str
    direction: str
    max_parallel: int
    prune: str
    prune_warmup_epochs: int
    pack: Pack | None = None  # no key in the config: one SLURM job per trial

    def __post_init__(self) -> None:
        if isinstance(self.pack, Mapping):  # as written in the config
            object.__setattr__(self, "pack", section(Pack, self.pack))


@dataclass(frozen=True)
class Pruning:
    """How a trial's training prunes itself at epoch ends
    (:mod:`ddppipe.training.loop.pruning`)."""

    method: str  # median | halving
    metric: str
    direction: str  # maximize | minimize
    warmup_epochs: int
    # a reproduction of a pruned trial (ddppipe.reproduce.plan): stop at the end of this epoch,
    # where the trial's record says it was pruned, the sweep's study not asked
    at_epoch: int | None = None


@dataclass(frozen=True)
class TrialSection:
    """``trial:``, the section a trial's config carries (written by
    :func:`ddppipe.settings.sweep.apply` from a sweep's :class:`~ddppipe.settings.sweep.Trial`):
    the sweep a run is a trial of, its name and values, and how it prunes and packs."""

    sweep: str
    name: str
    values: Mapping[str, Any]
    prune: Pruning | None
    pack: Pack | None = None  # the sweep's sweep.pack: the allocations the trial trains in

    @classmethod
    def of(cls, value: Mapping[str, Any] | None) -> TrialSection | None:
        if value is None:
            return None
        prune, pack = value.get("prune"), value.get("pack")
        return cls(value["sweep"], value["name"], _frozen(value["values"]),
                   Pruning(**prune) if prune else None,
                   section(Pack, pack) if pack else None)  # fmt: skip


SECTIONS: dict[str, type] = {
    "train": Train, "launch": Launch, "slurm": Slurm, "container": Container,
    "tracking": Tracking, "scaling": Scaling, "sweep": SweepSection, "data": Data,
}  # fmt: skip


def _frozen(value: Any) -> Any:
    """``value`` with its dicts read-only and its lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def section(cls: type, values: Mapping[str, Any]) -> Any:
    """The section ``cls`` (e.g. :class:`Container`) of a config's section ``values`` (a key
    with no schema default, absent, keeps its field's default)."""
    fields = dataclasses.fields(cls)
    return cls(**{f.name: _frozen(values[f.name]) for f in fields if f.name in values})


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: its sections, the device it trains on and what it runs."""

    run: str
    task: str
    task_args: Mapping[str, Any]
    script: str | None
    script_args: tuple[str, ...]
    task_source: Mapping[str, Any] | None
    device: Device  # decided once, where the run was resolved
    train: Train
    launch: Launch
    slurm: Slurm
    container: Container
    tracking: Tracking
    scaling: Scaling
    sweep: SweepSection
    data: Data
    trial: TrialSection | None  # the sweep this run is a trial of; None: not a trial
    _config: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RunSpec:
        """The spec of a config that :func:`resolve` produced (validated, preset applied)."""
        sections = {name: section(sec, cfg[name]) for name, sec in SECTIONS.items()}
        return cls(
            run=cfg["run"], task=cfg["task"], task_args=_frozen(cfg["task_args"]),
            script=cfg["script"], script_args=tuple(cfg["script_args"]),
            task_source=_frozen(cfg["task_source"]), device=cfg["resolved"]["device"],
            trial=TrialSection.of(cfg["trial"]), _config=_frozen(cfg), **sections,
        )  # fmt: skip

    @property
    def gpus(self) -> bool:
        """Whether the run trains on GPUs, one per process."""
        return self.device == "gpu"

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    @property
    def kind(self) -> layout.RunKind:
        """Whether the run trains a task or launches the user's torchrun script."""
        return layout.kind(self._config)

    def as_dict(self) -> dict[str, Any]:
        """The resolved config as plain, mutable dicts and lists (a copy), as it was written:
        for a file (its hash, a record), not to read inside ddppipe (read the spec's fields)."""
        return plain(self._config)

    def train_hash(self, data_digest: str) -> str:
        """Short hash of what determines the training's numbers (:func:`config.train_hash`)."""
        return config.train_hash(self.as_dict(), data_digest)


def plain(value: Any) -> Any:
    """A spec's (frozen) ``value`` as plain, mutable dicts and lists (a copy), as the config
    file has it: e.g. the task's arguments for its hooks, which get a dict."""
    return json.loads(json.dumps(value, default=_plain))


def _plain(value: Any) -> Any:
    if isinstance(value, MappingProxyType):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def resolve(cfg: Mapping[str, Any], gpus: bool) -> RunSpec:
    """The spec of a user's config: validated, its preset applied, its device recorded
    (:func:`ddppipe.settings.config.resolve`; ``gpus``: whether it trains on GPUs, as
    :func:`ddppipe.parallel.devices.trains_on_gpus` decided it where the run is submitted).
    """
    return RunSpec.from_config(config.resolve(dict(cfg), gpus))


def load(path: str | Path) -> RunSpec:
    """The spec of a resolved config file (``results/<run>/config.yaml``): validated here, once."""
    return RunSpec.from_config(config.load_resolved(path))
