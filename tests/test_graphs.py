"""Whether a run's step is captured as a CUDA graph (``train.cuda_graphs``): the decision, a
pure function of the run's facts, as a table; the facts read from built parts; the key's
values. Milliseconds, no GPU: the graphed step itself is tested in tests/test_gpu_graphs.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from ddppipe.settings import config, run_spec
from ddppipe.training.loop import graphs, optim
from tests.tiny import default_config

GPU = graphs.Facts(device="cuda", optimizer="AdamW", fused=True, schedule="StepLR")
SYNC = "the step synchronises with the host (called a synchronizing CUDA operation)"

# (name, mode, facts, measured, captured, update, tensor betas, words in the reason)
CASES: list[tuple[str, str, graphs.Facts, bool, bool, str | None, bool, str]] = [
    ("off", "off", GPU, True, False, None, False, "train.cuda_graphs: off"),
    ("on, fused AdamW, StepLR", "on", GPU, False, True, "fused", False,
     "AdamW's fused step reading the learning rate from device tensors"),
    ("on, the gpu recipe: AdamW and onecycle's betas", "on",
     replace(GPU, schedule="OneCycleLR", cycles_momentum=True), False, True, "foreach", True,
     "AdamW's foreach step reading the learning rate and betas from device tensors"),
    ("on, a smaller last batch: eager", "on", replace(GPU, tail=96), False, True, "fused",
     False, "an epoch's last batch (96 samples here) eager"),
    ("on, Adam not fused", "on", replace(GPU, optimizer="Adam", fused=False), False, True,
     "foreach", False, "Adam's foreach step"),
    ("auto, unmeasured", "auto", GPU, False, False, None, False,
     "auto: no GPU measurement shows the graphed step faster and correct yet (it could be "
     "captured: fused optimizer step)"),
    ("auto, measured", "auto", GPU, True, True, "fused", False, "one CUDA graph"),
    ("on, CPU", "on", replace(GPU, device="cpu"), True, False, None, False,
     "the step runs on cpu, not a CUDA GPU"),
    ("auto, CPU: the device's reason", "auto", replace(GPU, device="cpu"), False, False, None,
     False, "the step runs on cpu, not a CUDA GPU"),
    ("DDP at 2 ranks", "on", replace(GPU, world_size=2), True, False, None, False,
     "DDP at 2 ranks: capturing its all-reduce needs NCCL's asynchronous error handling off"),
    ("FSDP2", "on", replace(GPU, strategy="fsdp"), True, False, None, False,
     "launch.strategy fsdp: FSDP2 gathers and reduce-scatters"),
    ("HSDP", "on", replace(GPU, strategy="hsdp"), True, False, None, False,
     "launch.strategy hsdp"),
    ("micro-steps", "on", replace(GPU, micro_steps=2), True, False, None, False,
     "2 micro-steps a step"),
    ("activation checkpointing", "on", replace(GPU, activation_checkpointing=True), True, False,
     None, False, "train.activation_checkpointing"),
    ("SGD with a cycled momentum", "on", replace(GPU, optimizer="SGD", schedule="OneCycleLR",
     cycles_momentum=True), True, False, None, False,
     "SGD's momentum is a number its kernels take, and OneCycleLR changes it every step"),
    ("fused SGD, StepLR", "on", replace(GPU, optimizer="SGD"), True, True, "fused", False,
     "SGD's fused step"),
    ("SGD not fused", "on", replace(GPU, optimizer="SGD", fused=False), True, False, None,
     False, "SGD without fused kernels"),
    ("Adadelta", "on", replace(GPU, optimizer="Adadelta", fused=False), True, False, None,
     False, "the optimizer Adadelta: ddppipe captures Adam, AdamW"),
    ("a task's optimizer of its own", "on", replace(GPU, optimizer="Lion",
     torch_optimizer=False), True, False, None, False, "(Lion) is no torch.optim.Optimizer"),
    ("differentiable", "on", replace(GPU, differentiable=True), True, False, None, False,
     "differentiable=True"),
    ("a task's tensor learning rate", "on", replace(GPU, tensor_lr=True), True, False, None,
     False, "AdamW's learning rate is a tensor of the task's already"),
    ("a host sync found in the warm-up", "on", replace(GPU, warm_up=SYNC), True, False, None,
     False, SYNC),
    ("shapes that vary", "on", replace(GPU, warm_up="the full batches' shapes vary"), True,
     False, None, False, "shapes vary"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "mode", "facts", "measured", "captured", "update", "betas", "words"),
    CASES, ids=[c[0] for c in CASES],
)  # fmt: skip
def test_the_decision_and_its_reason(
    name: str, mode: Any, facts: graphs.Facts, measured: bool, captured: bool,
    update: str | None, betas: bool, words: str,
) -> None:  # fmt: skip
    decision = graphs.decide(mode, facts, measured=measured)
    assert (decision.capture, decision.update, decision.tensor_betas) == (captured, update, betas)
    assert words in decision.reason, decision.reason
    assert decision.configured == mode
    assert decision.as_dict()["reason"] == decision.reason


def test_auto_is_off_until_the_gpu_suite_measured_it() -> None:
    """No GPU measurement exists: ``auto`` resolves to eager everywhere, saying so."""
    assert graphs.MEASURED is False
    assert not graphs.decide("auto", GPU).capture


def test_a_fall_back_keeps_what_was_configured() -> None:
    fell = graphs.decide("on", GPU).fallen_back("the capture failed (RuntimeError: x)")
    assert fell.as_dict() == {"configured": "on", "capture": False,
                              "reason": "the capture failed (RuntimeError: x)"}  # fmt: skip


def test_the_facts_of_built_parts() -> None:
    """The recipe's parts on a CPU: fused AdamW, onecycle cycling its betas."""
    spec = run_spec.resolve(default_config(), gpus=False)
    recipe = replace(spec.train, optimizer="adamw", schedule="onecycle")
    model = torch.nn.Linear(2, 2)
    optimizer = optim.make_optimizer(model.parameters(), recipe, torch.device("cpu"))
    scheduler = optim.make_scheduler(optimizer, recipe, steps_per_epoch=4)
    facts = graphs.facts_of(optimizer, scheduler, torch.device("cpu"), 1, "ddp", 1, False, 0)
    assert facts == graphs.Facts(device="cpu", optimizer="AdamW", fused=True,
                                 schedule="OneCycleLR", cycles_momentum=True)  # fmt: skip
    recipe = replace(recipe, optimizer="sgd", schedule="step")
    optimizer = optim.make_optimizer(model.parameters(), recipe, torch.device("cpu"))
    scheduler = optim.make_scheduler(optimizer, recipe, steps_per_epoch=4)
    facts = graphs.facts_of(optimizer, scheduler, torch.device("cpu"), 2, "fsdp", 1, True, 3)
    assert (facts.optimizer, facts.fused, facts.schedule, facts.cycles_momentum) == (
        "SGD", True, "StepLR", False)  # fmt: skip
    assert (facts.world_size, facts.strategy, facts.activation_checkpointing, facts.tail) == (
        2, "fsdp", True, 3)  # fmt: skip


@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), ("on", "on"), ("off", "off"),
                                             (True, "on"), (False, "off")])  # fmt: skip
def test_the_key_takes_auto_on_off_and_yamls_booleans(value: Any, mode: str) -> None:
    cfg = default_config()
    cfg["train"]["cuda_graphs"] = value
    assert run_spec.resolve(cfg, gpus=False).train.cuda_graphs == mode


def test_the_key_defaults_to_auto_and_is_not_in_the_config_hash() -> None:
    cfg = default_config()
    assert run_spec.resolve(cfg, gpus=False).train.cuda_graphs == "auto"
    on = default_config()
    on["train"]["cuda_graphs"] = "on"
    assert config.train_hash(config.resolve(cfg, False), "d") == config.train_hash(
        config.resolve(on, False), "d"
    )


@pytest.mark.parametrize("value", ["yes", "graphs", 1])
def test_a_bad_value_names_the_key(value: Any) -> None:
    cfg = default_config()
    cfg["train"]["cuda_graphs"] = value
    with pytest.raises(config.ConfigError, match=r"train\.cuda_graphs: .* is not one of"):
        run_spec.resolve(cfg, gpus=False)
