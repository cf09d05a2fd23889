"""The recipe's optimizer and schedule (ddppipe.training.loop.optim) and a rank's random streams
(ddppipe.training.loop.rng), built from the typed run spec."""

from __future__ import annotations

import dataclasses

import torch

from ddppipe.settings import run_spec
from ddppipe.training.loop import optim, rng
from tests.tiny import default_config

CPU = torch.device("cpu")


def recipe(**changes: object) -> run_spec.Train:
    return dataclasses.replace(run_spec.resolve(default_config(), gpus=False).train, **changes)


def test_sgd_is_nesterov_with_fused_kernels() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = optim.make_optimizer(params, recipe(optimizer="sgd", lr=0.5, weight_decay=0.01), CPU)
    group = sgd.param_groups[0]
    assert isinstance(sgd, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.9, True)
    assert (group["weight_decay"], group["fused"]) == (0.01, True)
    assert optim.optimizer_kernels("adadelta", CPU) == {}  # its foreach loop is slower on CPU


def test_sgd_of_a_sharded_model_takes_its_foreach_kernels() -> None:
    """Fused SGD has no sharding strategy for FSDP2's DTensors (fused AdamW has one)."""
    assert optim.optimizer_kernels("sgd", CPU, sharded=True) == {"foreach": True}
    assert optim.optimizer_kernels("adamw", CPU, sharded=True) == {"fused": True}


def test_onecycle_spans_every_step_of_the_run() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    train = recipe(optimizer="adamw", schedule="onecycle", lr=0.1, epochs=3)
    scheduler = optim.make_scheduler(optim.make_optimizer(params, train, CPU), train, 10)
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
    assert scheduler.total_steps == 30


def test_only_a_schedule_that_changes_the_rate_is_stepped() -> None:
    """A constant schedule's step changes nothing: the training does not step it."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    stepped = {}
    for name in ("constant", "step", "onecycle"):
        train = recipe(optimizer="adamw", schedule=name, lr=0.1, epochs=2, gamma=0.5)
        optimizer = optim.make_optimizer(params, train, CPU)
        stepped[name] = optim.changes_lr(optim.make_scheduler(optimizer, train, 10))
    assert stepped == {"constant": False, "step": True, "onecycle": True}
    halved = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=3)
    assert optim.changes_lr(halved)  # (torch's ConstantLR at another factor: a change)


def test_a_restored_stream_draws_the_same_numbers() -> None:
    saved = rng.state(CPU)
    first = torch.rand(4)
    rng.restore(saved, CPU)
    assert torch.equal(torch.rand(4), first)
    assert rng.rank_seed(1, 0, 0) == 4_099_012_298
    assert rng.rank_seed(1, 0, 1) == 4_099_012_299  # every rank its own stream
