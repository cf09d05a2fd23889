"""A DDP checkpoint's tensors copied off the training thread (background_copy), saved through
the sharded store in one process (a gloo group of one), and what each save costs."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ddppipe.parallel import distributed, precision
from ddppipe.reports import slot_lines
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import background_copy, checkpoint, sharded_checkpoint
from ddppipe.training.loop import run_checkpoints, strategy
from ddppipe.training.measuring import save_costs
from tests.tiny import default_config

SLOW_S = 0.2  # the worker's copy takes at least this long once the step is reached


def model_and_optimizer(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with BatchNorm (buffers its forward changes) and Adam, one step trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)  # (it wraps the step, as the training's)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 8, device=next(model.parameters()).device)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cloned(state: Any) -> Any:
    """``state`` with every tensor copied now (what the checkpoint must hold)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cloned(v) for v in state]
    return state


def zeroed(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeroed(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeroed(v) for v in state]
    return state


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def state(epoch: int = 1, step: int = 0) -> dict[str, Any]:
    return {"config_hash": "abc", "epoch": epoch, "step": step, "scheduler": {}, "rng": [],
            "history": [], "meta": {}}  # fmt: skip


@contextmanager
def held_until_a_step(copier: background_copy.BackgroundCopy) -> Iterator[None]:
    """The worker's copy held back until an optimizer step begins, then ``SLOW_S`` more (a
    large model's copy, a slow machine): whatever the machine's load, the step finds it in
    flight (torch runs its global step pre-hooks before the optimizer's own)."""
    reached, take = threading.Event(), copier._take

    def slow(*args: Any) -> Any:
        reached.wait(60)
        time.sleep(SLOW_S)
        return take(*args)

    copier._take = slow  # type: ignore[method-assign]
    hook = register_optimizer_step_pre_hook(lambda *args: reached.set())
    try:
        yield
    finally:
        hook.remove()
        reached.set()


@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_holds_the_weights_of_its_step_while_training_goes_on(
    tmp_path: Path,
) -> None:
    """The save returns before its copy; the next step's forward and backward run meanwhile
    (BatchNorm's running statistics change), its optimizer step waits for the copy: the
    checkpoint holds, bitwise, the model's and Adam's tensors at the save. (On a GPU:
    tests/test_gpu_paths.py.)"""
    holds_its_step("cpu", tmp_path)


def holds_its_step(device: str, folder: Path) -> None:
    """The checkpoint of a model on ``device`` saved while its next step runs holds, bitwise,
    the tensors at the save (in a process group, its copy held back until the step)."""
    model, optimizer = model_and_optimizer(device)
    waits: list[float] = []
    copier = background_copy.BackgroundCopy(optimizer, torch.device(device), waits.append)
    store = sharded_checkpoint.Store(folder, group=dist.new_group(backend="gloo"),
                                     copier=copier)  # fmt: skip
    expected = cloned(sharded_checkpoint.tensors_of(model, optimizer))
    with held_until_a_step(copier):
        store.save(state(), sharded_checkpoint.tensors_of(model, optimizer), {})
        assert store.in_flight()  # returned before the copy
        train_step(model, optimizer)  # forward, backward, then the step: it waits for the copy
        assert len(waits) == 1 and waits[0] >= SLOW_S * 0.9
    written = store.wait()
    assert written is not None and written.copy_s >= SLOW_S and written.write_s > 0
    assert written.seconds >= written.copy_s + written.write_s
    # The live tensors moved on: the running statistics at the forward, the rest at the step.
    now = sharded_checkpoint.tensors_of(model, optimizer)
    assert not torch.equal(now["model"]["1.running_mean"], expected["model"]["1.running_mean"])
    assert not torch.equal(now["model"]["0.weight"], expected["model"]["0.weight"])
    loaded = zeroed(expected)
    store.load(written.path, loaded)
    assert_bitwise(loaded, expected)
    copier.shut()


@pytest.mark.usefixtures("one_rank")
def test_the_trainings_ddp_checkpoints_count_the_next_steps_wait_for_the_copy(
    tmp_path: Path,
) -> None:
    """The training's own checkpoints (run_checkpoints) of a ddp run: a save by time returns
    with its copy in flight, and the next step's wait for it counts as that save's blocking
    (the slot's checkpoint_s, checkpoint_max_s), its copy and write as theirs."""
    spec = run_spec.resolve(default_config(), gpus=False)  # launch.strategy: ddp
    model, optimizer = model_and_optimizer()
    parts = checkpoint.Trainable(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    costs = save_costs.SaveCosts()
    cpu = torch.device("cpu")
    saves = run_checkpoints.Checkpoints(
        spec, StateDir(tmp_path), distributed.Context(0, 0, 1, cpu, "gloo", "test", 1),
        strategy.of(spec.launch), parts, config_hash="abc", steps_per_epoch=10,
        record=lambda **_: None, precision=precision.Decision("fp32", "fp32"), costs=costs,
    )  # fmt: skip
    assert saves.store.copier is not None
    with held_until_a_step(saves.store.copier):
        saves.save(run_checkpoints.Position(0, 3, []), timed=True)
        assert saves.store.in_flight()
        starting_s = costs.blocked_s
        train_step(model, optimizer)
    path = saves.wait()
    assert path is not None and path.name == "ckpt-e0000-s000003"
    figures = costs.figures()
    assert (figures["checkpoints"], figures["timed_checkpoints"]) == (1, 1)
    assert figures["checkpoint_s"] - starting_s >= SLOW_S * 0.9  # the step's wait
    assert figures["checkpoint_max_s"] == figures["checkpoint_s"]
    assert figures["checkpoint_copy_s"] >= SLOW_S and figures["checkpoint_write_s"] > 0
    saves.store.copier.shut()


@pytest.mark.usefixtures("one_rank")
def test_a_committed_save_is_recorded_before_it_is_waited_for(tmp_path: Path) -> None:
    """A save by time, committed in the background: the next agreement's look at the clock
    records its step and folder in the attempt record, before any wait for it (a slot that
    then loses a node or crashes said the step before, 0 at its first save)."""
    spec = run_spec.resolve(default_config(), gpus=False)
    model, optimizer = model_and_optimizer()
    parts = checkpoint.Trainable(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    recorded: list[dict[str, Any]] = []
    saves = run_checkpoints.Checkpoints(
        spec, StateDir(tmp_path), distributed.Context(0, 0, 1, torch.device("cpu"), "gloo",
                                                      "test", 1),
        strategy.of(spec.launch), parts, config_hash="abc", steps_per_epoch=10,
        record=lambda **changes: recorded.append(changes),
        precision=precision.Decision("fp32", "fp32"), costs=save_costs.SaveCosts(),
    )  # fmt: skip
    saves.save(run_checkpoints.Position(1, 3, []), timed=True)
    train_step(model, optimizer)  # (the step waits for the copy)
    deadline = time.monotonic() + 60
    while saves.store.in_flight():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert recorded == []
    saves.due()
    assert recorded == [{"end_step": 13, "checkpoint": "ckpt-e0001-s000003"}]
    saves.due()  # once
    assert len(recorded) == 1
    saves.wait()
    assert recorded[-1]["end_step"] == 13 and "checkpoint_seconds" in recorded[-1]
    assert saves.store.copier is not None
    saves.store.copier.shut()


@pytest.mark.usefixtures("one_rank")
def test_the_copy_buffers_are_kept_and_one_copy_is_in_flight_at_a_time(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    copier = background_copy.BackgroundCopy(optimizer, torch.device("cpu"))
    tensors = sharded_checkpoint.tensors_of(model, optimizer)
    first = copier.stage(tensors).result()
    gate = threading.Event()
    original = copier._take
    copier._take = lambda *args: gate.wait() and original(*args)  # type: ignore[method-assign]
    held = copier.stage(tensors)
    with pytest.raises(RuntimeError, match="copy is still in flight: wait for its save"):
        copier.stage(tensors)
    gate.set()
    second = held.result()
    weight, step = ("model", "0.weight"), ("optimizer", "state", "0.weight", "step")

    def at(staged: dict, path: tuple[str, ...]) -> torch.Tensor:
        for key in path:
            staged = staged[key]
        return staged  # type: ignore[return-value]

    for path in (weight, step):  # the same CPU memory, not the live tensor's
        assert at(first, path).data_ptr() == at(second, path).data_ptr()
        assert at(first, path).data_ptr() != at(tensors, path).data_ptr()
    # A non-tensor value (Adam's learning rate) is kept as it is
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.1
    copier.shut()


def test_what_saves_cost_is_counted_save_by_save() -> None:
    costs = save_costs.SaveCosts()
    costs.started(0.5, timed=True)
    costs.gated(0.25)  # its copy held the next step
    costs.waited_for_previous(1.0)
    costs.started(1.25, timed=False)  # waited 1.0 of it for the first one's write
    costs.committed(copy_s=0.75, write_s=2.0)
    costs.committed(copy_s=0.5, write_s=3.0)
    assert costs.figures() == {
        "checkpoints": 2, "timed_checkpoints": 1,
        "checkpoint_s": 2.0, "checkpoint_max_s": 1.25,
        "checkpoint_queued": 1, "checkpoint_queued_s": 1.0,
        "checkpoint_copy_s": 1.25, "checkpoint_copy_max_s": 0.75,
        "checkpoint_write_s": 5.0, "checkpoint_write_max_s": 3.0,
    }  # fmt: skip


def test_the_summary_says_what_the_last_slots_saves_cost() -> None:
    """The figures SaveCosts gives, as the summary's checkpoints line (reports.slot_lines)."""
    costs = save_costs.SaveCosts()
    for blocked_s, gated_s in ((0.03, 0.01), (0.02, 0.0), (0.05, 0.02)):
        costs.started(blocked_s, timed=True)
        costs.gated(gated_s)
        costs.committed(copy_s=0.012, write_s=0.4)
    costs.waited_for_previous(0.25)  # a fourth, at the epoch's end, behind the third's write
    costs.started(0.27, timed=False)
    costs.committed(copy_s=0.012, write_s=2.8)
    figures = {"startup_s": 5.0, "train_s": 50.0, "cpu_s": 50.0, **costs.figures()}
    attempt = {"job": "local", "nodes": ["n0"], "start": 0.0, "end": 60.0, "world_size": 1,
               "outcome": "completed", "efficiency": figures}  # fmt: skip
    lines = dict(slot_lines.efficiency(None, [attempt]))
    assert lines["checkpoints"] == (
        "4 in the last slot (3 by time): training blocked 100 ms a save (at most 270 ms), 1 of "
        "them waited 250 ms for the previous one's write; a save's copy 12 ms, its write 1.0 s "
        "(in the background)"
    )
