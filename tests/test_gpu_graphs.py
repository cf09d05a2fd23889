"""The training step as a CUDA graph (``train.cuda_graphs: on``, ddppipe.training.loop.graphs)
on one GPU: the same losses as eager steps within tolerance (the gpu recipe's AdamW with
onecycle's betas as device tensors, fused AdamW, fused SGD; an epoch's smaller last batch
eager), a resumed run the same as an uninterrupted one (the scheduler's numbers exactly, the
checkpoint an eager one), a model it cannot capture trained eagerly with the reason, and a
whole run through ``ddppipe launch`` with its decision in the attempt record.

Each test's ``seconds`` is its expected time on one H100-class GPU (`make test-gpu`'s plan,
tests/gpu_plan.py); without a GPU each skips, named. Not run on a GPU yet: no GPU was lent
when they were written (docs/gpus.md).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddppipe.data import batches
from ddppipe.settings import run_spec
from ddppipe.training.loop import graphs, optim, stepping
from tests.test_gpu_paths import gpu_tiny, history, launch
from tests.tiny import TinyData, default_config

ROWS, TAIL, STEPS = 64, 40, 9  # a full batch, the epoch's last, full steps an epoch


def model_of(kind: str) -> nn.Module:
    if kind == "host sync":
        return HostSync()
    # (no bias before the BatchNorm: a parameter without gradient, which Adam's step would
    # move by its rounding noise, the eager and graphed runs' apart)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 28 * 28, 10),
    )  # fmt: skip


class HostSync(nn.Module):
    """A model that reads a value on the host every forward: not capturable."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.abs().max())  # (a host read: a synchronisation)
        return self.linear(x.flatten(1) / max(scale, 1.0))


def data(epochs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``epochs`` epochs: STEPS full ones, then a smaller last one, each."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(epochs):
        for rows in [ROWS] * STEPS + [TAIL]:
            x = torch.randn(rows, 1, 28, 28, generator=g)
            out.append((x.cuda(), torch.randint(0, 10, (rows,), generator=g).cuda()))
    return out


def parts(kind: str, optimizer: str, schedule: str, precision: str) -> tuple[Any, ...]:
    """A model, the recipe's optimizer and schedule, its stepper, on the GPU (seed 0)."""
    torch.manual_seed(0)
    model = model_of(kind).cuda()
    recipe = replace(run_spec.resolve(default_config(), gpus=True).train, optimizer=optimizer,
                     schedule=schedule, epochs=2, lr=0.01)  # fmt: skip
    opt = optim.make_optimizer(model.parameters(), recipe, torch.device("cuda"))
    sched = optim.make_scheduler(opt, recipe, STEPS + 1)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    stepper = stepping.Stepper(model, opt, sched, nn.functional.cross_entropy, dtype,
                               torch.contiguous_format, 1)  # fmt: skip
    return model, opt, sched, stepper


def graphed(stepper: stepping.Stepper, reported: list[graphs.Decision]) -> graphs.GraphedStepper:
    facts = graphs.facts_of(stepper.optimizer, stepper.scheduler, torch.device("cuda"), 1, "ddp",
                            1, False, TAIL)  # fmt: skip
    decision = graphs.decide("on", facts)
    assert decision.capture, decision.reason
    return graphs.GraphedStepper(stepper, facts, decision, ROWS, reported.append)


def train(step: Any, batches_: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches_:
        share = batches.Share((x, y), len(y), len(y))
        losses.append(step(share).clone())  # (a graph's loss is static: copied each step)
    return [float(v) for v in losses]


CASES = [("adamw", "onecycle", "bf16"), ("adamw", "step", "fp32"), ("sgd", "step", "fp32")]


@pytest.mark.gpu(seconds=5)
@pytest.mark.parametrize(("optimizer", "schedule", "precision"), CASES)
def test_graphed_steps_train_as_eager_ones(
    optimizer: str, schedule: str, precision: str, record_property: Any
) -> None:
    """Two epochs of 9 full batches and a smaller last one: the graphed steps' losses and
    final weights are the eager steps' within tolerance; the smaller batches ran eagerly."""
    batches_ = data(epochs=2)
    model, _, _, stepper = parts("cnn", optimizer, schedule, precision)
    eager = train(stepper, batches_)
    eager_weights = copy.deepcopy(model.state_dict())
    model, opt, sched, stepper = parts("cnn", optimizer, schedule, precision)
    reported: list[graphs.Decision] = []
    step = graphed(stepper, reported)
    losses = train(step, batches_)
    assert reported == [], reported  # no fall-back
    # captured at the 4th step; both epochs' smaller last batches eager, after it
    assert step.graph is not None and step.eager_steps == 2
    assert step.replays == 2 * STEPS - graphs.WARMUP_STEPS
    tolerance = 2e-2 if precision == "bf16" else 1e-4
    torch.testing.assert_close(losses, eager, rtol=tolerance, atol=tolerance)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value.float(), eager_weights[key].float(), rtol=tolerance,
                                   atol=tolerance, msg=key)  # fmt: skip
    # the optimizer's groups hold numbers, as an eager run's: a checkpoint of it is an eager one
    group = opt.state_dict()["param_groups"][0]
    assert isinstance(group["lr"], float) and group["lr"] == sched.get_last_lr()[0]
    assert group.get("capturable", False) is False and group.get("fused") is True
    record_property(
        "max_loss_difference", max(abs(a - b) for a, b in zip(losses, eager, strict=True))
    )


@pytest.mark.gpu(seconds=5)
def test_a_graphed_run_resumes_as_it_would_have_gone_on() -> None:
    """Eleven graphed steps, its state saved after the 5th (model, optimizer, schedule), a new
    stepper loaded from it for the rest: the schedule's numbers exactly those of the run that
    went on, the losses and weights within tolerance (the new one warms up eagerly again)."""
    batches_ = data(epochs=2)[:12]
    model, opt, sched, stepper = parts("cnn", "adamw", "onecycle", "fp32")
    step = graphed(stepper, [])
    whole = train(step, batches_)
    model2, opt2, sched2, stepper2 = parts("cnn", "adamw", "onecycle", "fp32")
    first = train(graphed(stepper2, []), batches_[:5])
    saved = copy.deepcopy({"model": model2.state_dict(), "optimizer": opt2.state_dict(),
                           "schedule": sched2.state_dict()})  # fmt: skip
    model3, opt3, sched3, stepper3 = parts("cnn", "adamw", "onecycle", "fp32")
    model3.load_state_dict(saved["model"])
    opt3.load_state_dict(saved["optimizer"])
    sched3.load_state_dict(saved["schedule"])
    rest = train(graphed(stepper3, []), batches_[5:])
    assert sched3.state_dict() == sched.state_dict()  # the schedule's numbers, exactly
    assert opt3.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt3.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    torch.testing.assert_close(first + rest, whole, rtol=1e-4, atol=1e-4)
    for key, value in model3.state_dict().items():
        torch.testing.assert_close(value.float(), model.state_dict()[key].float(), rtol=1e-4,
                                   atol=1e-4, msg=key)  # fmt: skip


@pytest.mark.gpu(seconds=5)
def test_a_model_it_cannot_capture_trains_eagerly_and_says_why() -> None:
    """A model that reads a value on the host: found in the warm-up, never captured, its
    reason reported; it trains as eager steps do."""
    batches_ = data(epochs=1)
    _, _, _, stepper = parts("host sync", "adamw", "step", "fp32")
    eager = train(stepper, batches_)
    _, _, _, stepper = parts("host sync", "adamw", "step", "fp32")
    reported: list[graphs.Decision] = []
    step = graphed(stepper, reported)
    losses = train(step, batches_)
    assert step.graph is None and len(reported) == 1
    decision = reported[0]
    assert not decision.capture and decision.configured == "on"
    assert "synchronises with the host" in decision.reason, decision.reason
    torch.testing.assert_close(losses, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu(seconds=25)
def test_a_run_with_cuda_graphs_on_records_its_decision(
    tiny: TinyData, tmp_path: Path, record_property: Any
) -> None:
    """``ddppipe launch`` of the tiny MNIST on one GPU with graphs on (the gpu recipe: AdamW,
    onecycle, bf16, channels_last, a smaller last batch): the attempt record says what was
    decided and why, and no fall-back; it trains (the same losses as eager steps: above)."""
    cfg = gpu_tiny(tiny, epochs=2, batch_size=48, cuda_graphs="on")
    launch(tmp_path / "on", tiny.data_dir, cfg)
    (attempt,) = json.loads((tmp_path / "on" / "attempts.json").read_text())
    decided = attempt["cuda_graphs"]
    assert decided["configured"] == "on" and decided["capture"] is True, decided
    assert decided["update"] == "foreach" and decided["tensor_betas"] is True, decided
    assert decided["tail"] == "eager", decided
    epochs = history(tmp_path / "on")
    assert len(epochs) == 2 and all(0 < e["train_loss"] < 10 for e in epochs), epochs
    record_property("images_per_s_graphed", epochs[-1]["images_per_s"])
