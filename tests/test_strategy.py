"""What the training loop asks its strategy (ddppipe.training.loop.strategy): the one of
``launch.strategy``, and where DDP and FSDP2 differ, without a process group (the strategies'
training, checkpoints and resumption: test_fsdp.py, test_train_ddp.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import background_copy, checkpoint
from ddppipe.training.loop import evaluate, strategy
from tests.tiny import default_config

CPU = torch.device("cpu")
SPEC = run_spec.resolve(default_config(), gpus=False)


def of(name: str) -> strategy.Strategy:
    return strategy.of(dataclasses.replace(SPEC.launch, strategy=name))


def parts() -> checkpoint.Trainable:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return checkpoint.Trainable(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))


def test_ddp_replicates_and_fsdp_and_hsdp_shard() -> None:
    assert isinstance(of("ddp"), strategy.Replicated)
    assert all(isinstance(of(name), strategy.Sharded) for name in ("fsdp", "hsdp"))


class NotTorch:
    """A task's optimizer that is not a torch one (no step hook to make wait)."""

    def step(self) -> None: ...


def test_ddp_copies_a_checkpoint_off_the_training_thread_where_its_optimizer_can_wait() -> None:
    """(The copy itself: test_background_copy.py) FSDP's shards are DCP's to copy."""
    trainable, waited = parts(), lambda seconds: None
    copier = of("ddp").copier(trainable, CPU, waited)
    assert isinstance(copier, background_copy.BackgroundCopy)
    copier.shut()
    other = checkpoint.Trainable(trainable.model, NotTorch(), trainable.scheduler)
    assert of("ddp").copier(other, CPU, waited) is None
    assert of("fsdp").copier(trainable, CPU, waited) is None


def test_each_strategy_builds_the_optimizer_its_parameters_take() -> None:
    recipe = dataclasses.replace(SPEC.train, optimizer="sgd")
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert of("ddp").optimizer(params, recipe, CPU).param_groups[0]["fused"] is True
    assert of("fsdp").optimizer(params, recipe, CPU).param_groups[0]["foreach"] is True


def test_a_sharded_rank_with_fewer_test_batches_keeps_up_with_the_others() -> None:
    """FSDP's forward is collective: every rank runs as many forwards as the one with most."""
    counts = [evaluate.batch_count(9, r, 4, 2) for r in range(4)]
    assert len(set(counts)) > 1  # (the case: uneven shares)
    padding = [of("fsdp").eval_padding(9, r, 4, 2) for r in range(4)]
    assert [c + p for c, p in zip(counts, padding, strict=True)] == [max(counts)] * 4
    assert [of("ddp").eval_padding(9, r, 4, 2) for r in range(4)] == [0] * 4


def test_ddp_resumes_from_a_whole_model_checkpoint_and_fsdp_says_what_to_do() -> None:
    saved = parts()
    snapshot = {"model": saved.model.state_dict(), "optimizer": saved.optimizer.state_dict(),
                "scheduler": saved.scheduler.state_dict(), "epoch": 2, "step": 5,
                "history": [{"epoch": 1}]}  # fmt: skip
    into = parts()
    path = Path("ckpt-e0002-s000005.pt")
    assert of("ddp").resume_whole(path, snapshot, into) == (2, 5, [{"epoch": 1}])
    assert torch.equal(into.model.weight, saved.model.weight)
    with pytest.raises(checkpoint.CheckpointError, match=r"resume it once with launch\.strategy"):
        of("fsdp").resume_whole(path, snapshot, parts())


def test_ddp_exports_its_state_on_the_cpu() -> None:
    trained = parts()
    weights, optimizer = of("ddp").export(trained)
    assert torch.equal(weights["weight"], trained.model.weight.detach())
    assert set(optimizer) == {"state", "param_groups"}
