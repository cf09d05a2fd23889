"""What a slot of training cost and where its time went, measured by the ranks themselves.

Rank 0 times the phases of its slot (start-up until the first step, data loading, training
-- on a GPU with CUDA events, :class:`Clock` --, evaluation, checkpoints, the steps' wait for
their batches: :meth:`SlotMeter.fed`), the steady-state
throughput (the first :data:`WARMUP_STEPS` steps of a slot excluded, reported apart), and the
FLOPs of one training image (counted once with ``torch.utils.flop_counter``); every rank adds
its CPU time and its peak memory (its node's, and its own host and GPU peaks with what its
model and optimizer hold: :mod:`ddppipe.training.measuring.rank_memory`). The figures go into
the slot's attempt record (:mod:`ddppipe.runstate.attempts`). Judging them (waste flags,
utilisation of the peak) is the reports' part: :mod:`ddppipe.reports.waste`,
:mod:`ddppipe.reports.utilisation`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from ddppipe.core import env_names, process_times, slot
from ddppipe.runstate import startup
from ddppipe.training.measuring import save_costs

if TYPE_CHECKING:
    import torch

Mark: TypeAlias = "float | torch.cuda.Event"  # a Clock's reading
T = TypeVar("T")

WARMUP_STEPS = 10  # per slot: compilation, allocator and cache warm-up


class Clock:
    """Training time: CUDA events on a GPU (the device's own clock, read once the later event
    has completed), ``time.perf_counter`` on a CPU. Marks cost no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from mark ``start`` to the later mark ``end``."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class SlotMeter:
    """One rank's clocks for the current slot."""

    def __init__(self) -> None:
        found = slot.read()  # the launcher opened the slot at its start
        self.slot_start = found.start if found and found.start is not None else time.time()
        self.cpu_start = time.process_time()
        self.seconds: dict[str, float] = {}
        self.first_step_at: float | None = None
        self.steps = 0
        self.images = 0
        self.steady_images = 0
        self.steady_seconds = 0.0
        self.warmup_images = 0
        self.warmup_seconds = 0.0
        self.flops_per_image: float | None = None
        self.gpu: dict[str, Any] = {}  # the GPU's name and memory (measuring.gpu_usage)
        self.gpu_sampler: Any = None
        self.exposed_communication: tuple[float, int] | None = None  # (s a step, its images)
        self.saves = save_costs.SaveCosts()  # what the checkpoints cost
        self.device: Any = None  # the rank's device, model and optimizer (watch_memory)
        self.model: Any = None
        self.optimizer: Any = None

    def watch_memory(self, device: Any, model: Any, optimizer: Any) -> None:
        """Count ``model``'s and ``optimizer``'s tensors in the rank's memory figures."""
        self.device, self.model, self.optimizer = device, model, optimizer

    def watch_gpu(self, device: Any) -> None:
        """Sample the CUDA ``device``'s NVML utilisation and memory from the first step on."""
        from ddppipe.training.measuring import gpu_usage

        self.gpu = gpu_usage.describe(device)
        self.gpu_sampler = gpu_usage.Sampler(gpu_usage.nvml_reader(device))

    def communication(self, exposed_s: float, images: int) -> None:
        """A step of ``images`` (global) spent ``exposed_s`` waiting for its all-reduce."""
        self.exposed_communication = (max(0.0, exposed_s), images)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def fed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, the host's wait for each after the warm-up steps counted as the
        phase ``data_wait`` (its share of the steady training: ``data_wait_share``)."""
        it = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            if self.steps >= WARMUP_STEPS:  # a DataLoader's workers start in the warm-up
                self.add("data_wait", time.perf_counter() - started)
            yield item

    def training_started(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
            if self.gpu_sampler is not None:
                self.gpu_sampler.start()

    def stepped(self) -> None:
        """A step done; the first one's end is a start-up mark (on a GPU, once it ran)."""
        self.steps += 1
        if self.steps == 1:
            if self.device is not None and self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)
            process_times.mark("first_step")

    def trained(self, images: int, seconds: float, warmup_images: int,
                warmup_seconds: float) -> None:  # fmt: skip
        """An epoch's share of this slot: all its images, and how many came after warm-up."""
        self.images += images
        self.add("train", seconds)
        self.warmup_images += warmup_images
        self.warmup_seconds += warmup_seconds
        self.steady_images += images - warmup_images
        self.steady_seconds += seconds - warmup_seconds

    def collect(self, world_size: int) -> dict[str, Any]:
        """Collective: the slot's figures (complete on rank 0)."""
        import torch
        import torch.distributed as dist

        cpu = torch.tensor([time.process_time() - self.cpu_start], dtype=torch.float64)
        gpu = self.gpu_sampler.stop() if self.gpu_sampler is not None else None
        processes = [process_memory("self")]
        if os.environ.get("LOCAL_RANK", "0") == "0":  # the node's agent (or local launcher) too
            processes.append(process_memory(str(os.getppid())))
        private = sum(max(0.0, peak - files) for peak, files in processes)
        from ddppipe.training.measuring import rank_memory

        device = self.device if self.device is not None else torch.device("cpu")
        own = rank_memory.measure(device, self.model, self.optimizer)
        mine = (socket.gethostname(), private, max(files for _, files in processes), gpu, own,
                start_marks())  # fmt: skip
        ranks: list[Any] = [mine]  # every rank's, on rank 0 (elsewhere this rank's alone)
        if dist.is_initialized():
            from ddppipe.parallel import distributed

            cpu = cpu.to(distributed.collective_device())
            dist.all_reduce(cpu)
            gathered = [mine] * world_size if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            ranks = gathered or ranks
        per_node = node_memory([(host, mb, files) for host, mb, files, *_ in ranks])
        figures: dict[str, Any] = {
            "startup_s": (self.first_step_at or time.time()) - self.slot_start,
            **{f"{name}_s": value for name, value in sorted(self.seconds.items())},
            "images": self.images,
            "steps": self.steps,  # trained in this slot, checkpointed or not
            **self.saves.figures(),  # checkpoint_s: the training thread blocked by saves
            "cpu_s": float(cpu.cpu()),
            "memory_peak_mb": max(per_node.values()),  # the fullest node (node_memory)
            "memory": rank_memory.fullest([r[4] for r in ranks]),  # the fullest rank's
            # each start-up mark's latest rank (ddppipe.runstate.startup derives the parts)
            "startup_marks": startup.latest(r[5] for r in ranks),
        }
        if self.steady_seconds > 0:
            figures["images_per_s"] = self.steady_images / self.steady_seconds
            figures["images_per_s_per_process"] = figures["images_per_s"] / world_size
        if self.steady_seconds > 0:  # the steady steps' time spent waiting for batches
            figures["data_wait_share"] = min(1.0, self.seconds.get("data_wait", 0.0)
                                             / self.steady_seconds)  # fmt: skip
        if self.warmup_seconds > 0:
            figures["warmup_s"] = self.warmup_seconds  # the first WARMUP_STEPS steps' training
            figures["warmup_images_per_s"] = self.warmup_images / self.warmup_seconds
        if self.flops_per_image and "images_per_s" in figures:
            figures["flops_per_image"] = self.flops_per_image
            figures["achieved_gflops"] = self.flops_per_image * figures["images_per_s"] / 1e9
        if self.exposed_communication and "images_per_s" in figures:
            exposed, images = self.exposed_communication
            figures["communication_s"] = exposed  # a step's all-reduce not hidden by backward
            figures["communication_share"] = min(1.0, exposed * figures["images_per_s"] / images)
        sampled = [r[3] for r in ranks if r[3]]
        if self.gpu:
            figures.update(self.gpu)
        if sampled:  # every GPU's mean utilisation, averaged; the fullest GPU's memory
            figures["gpu_utilisation"] = sum(g["gpu_utilisation"] for g in sampled) / len(sampled)
            figures["gpu_memory_peak_mb"] = max(g["gpu_memory_peak_mb"] for g in sampled)
        return figures


def start_marks() -> dict[str, float]:
    """This rank's start-up marks, with its node's agent's (:mod:`ddppipe.runstate.startup`)."""
    agent = os.environ.get(env_names.AGENT_MARKS)
    return {**(json.loads(agent) if agent else {}), **process_times.own("rank_")}


def process_memory(pid: str) -> tuple[float, float]:
    """Process ``pid``'s (or ``self``'s) peak resident memory (``VmHWM``) and its file-backed
    part now (``RssFile``: torch's libraries, shared by the node's processes), in MB; zeros
    where /proc cannot tell."""
    found: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssFile"):
                    found[key] = int(value.split()[0]) / 1024  # kB
    except (OSError, ValueError):
        pass
    return found.get("VmHWM", 0.0), found.get("RssFile", 0.0)


def node_memory(per_rank: list[tuple[str, float, float]]) -> dict[str, float]:
    """Each node's memory peak from its ranks' (host, private peak, file-backed) MB.

    A rank's private peak is its peak RSS less its file-backed pages (local rank 0 adds its
    agent's). The file-backed pages (the libraries every process maps) count once, as the
    kernel and a job's cgroup count them: the largest is added once. Summing the peak RSS
    would count torch's libraries once per process.
    """
    shared: dict[str, float] = {}
    for host, _, files in per_rank:
        shared[host] = max(shared.get(host, 0.0), files)
    private = node_sums([(host, mine) for host, mine, _ in per_rank])
    return {host: private[host] + shared[host] for host in private}


def node_sums(per_process: list[tuple[str, float]]) -> dict[str, float]:
    """A figure per node: the sum of its processes' (GEMM GFLOP/s, private memory peaks)."""
    nodes: dict[str, float] = {}
    for host, value in per_process:
        nodes[host] = nodes.get(host, 0.0) + value
    return nodes


def count_flops_per_image(step: Any, images: int) -> float | None:
    """FLOPs of one training image: ``step()`` (forward and backward of ``images``) counted
    once with torch's FLOP counter; None where it cannot count (an unsupported operator)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            step()
    except Exception:  # a custom operator the counter does not know: no figure, no failure
        return None
    total = counter.get_total_flops()
    return total / images if total and images else None
