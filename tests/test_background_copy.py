"""A DDP checkpoint's tensors copied off the training thread (background_copy), saved through
the sharded store in one process (a gloo group of one), and what each save costs."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddppipe.training.checkpoints import background_copy, sharded_checkpoint
from ddppipe.training.measuring import save_costs

SLOW_S = 0.4  # the worker's copy held back this long


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone (gloo)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_and_optimizer(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with BatchNorm (buffers its forward changes) and Adam, one step trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
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


def slowed(copier: background_copy.BackgroundCopy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold the worker's copy back ``SLOW_S`` (a large model's copy)."""
    take = copier._take

    def slow(*args: Any) -> Any:
        time.sleep(SLOW_S)
        return take(*args)

    monkeypatch.setattr(copier, "_take", slow)


@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_holds_the_weights_of_its_step_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save returns before its copy; the next step's forward and backward run meanwhile
    (BatchNorm's running statistics change), its optimizer step waits for the copy: the
    checkpoint holds, bitwise, the model's and Adam's tensors at the save. (On a GPU:
    tests/test_gpu_paths.py.)"""
    holds_its_step("cpu", tmp_path, monkeypatch)


def holds_its_step(device: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint of a model on ``device`` saved while its next step runs holds, bitwise,
    the tensors at the save (in a process group, its copy held back ``SLOW_S``)."""
    model, optimizer = model_and_optimizer(device)
    waits: list[float] = []
    copier = background_copy.BackgroundCopy(optimizer, torch.device(device), waits.append)
    slowed(copier, monkeypatch)
    store = sharded_checkpoint.Store(folder, group=dist.new_group(backend="gloo"),
                                     copier=copier)  # fmt: skip
    expected = cloned(sharded_checkpoint.tensors_of(model, optimizer))
    started = time.perf_counter()
    store.save(state(), sharded_checkpoint.tensors_of(model, optimizer))
    assert time.perf_counter() - started < SLOW_S  # the training thread did not copy
    assert store.in_flight()
    train_step(model, optimizer)  # forward, backward, then the step: it waits for the copy
    assert len(waits) == 1 and waits[0] > 0
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
