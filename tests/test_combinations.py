"""Every documented combination of launch.strategy x preset x optimizer x precision x activation
checkpointing trains (#42): the MNIST task's model as the trainer builds it
(``config.resolve``, ``wrapping.wrap``, ``optim.make_optimizer``, ``evaluate.loss_of``), two
steps on two gloo ranks (CPU), hsdp on a 2 x 1 mesh. Under the fast preset (the BatchNorm
variant, channels_last, the combinations that failed) every combination; under the reference
preset (no BatchNorm) each strategy with each optimizer. The combinations that cannot train
are refused when the config resolves."""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddppipe.settings import config
from tests.tiny import REPO, default_config

STRATEGIES = ("ddp", "fsdp", "hsdp")
OPTIMIZERS = ("adamw", "sgd", "adadelta")
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = (False, True)
STEPS = 2

# Each rank trains every combination in turn; rank 0 writes what each one gave.
RANKS = """
import itertools, json, os, sys
import torch
import torch.distributed as dist
from ddppipe import tasks
from ddppipe.parallel import wrapping
from ddppipe.settings import config, run_spec
from ddppipe.training.loop import evaluate, optim

dist.init_process_group("gloo")
rank = dist.get_rank()
combos, out, steps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
task = tasks.load("ddppipe.tasks.mnist")
results = {}
for key, cfg in combos.items():
    spec = run_spec.RunSpec.from_config(config.resolve(cfg, gpus=False))
    recipe, launch = spec.train, spec.launch
    dtype, layout = evaluate.numerics(recipe.precision, recipe.channels_last)
    torch.manual_seed(0)
    model = task.call("model", run_spec.plain(spec.task_args)).to(memory_format=layout)
    try:
        net = wrapping.wrap(model, torch.device("cpu"), launch.strategy, launch.nnodes,
                            launch.nproc_per_node, bf16=dtype == torch.bfloat16,
                            activation_checkpointing=recipe.activation_checkpointing)
        opt = optim.make_optimizer(net.parameters(), recipe, torch.device("cpu"),
                                   launch.strategy != "ddp")
        generator = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(steps):
            x = torch.randn(8, 1, 28, 28, generator=generator)
            y = torch.randint(0, 10, (8,), generator=generator)
            loss = evaluate.loss_of(net, (x, y), torch.nn.functional.cross_entropy, dtype, layout)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        tracked = [int(m.num_batches_tracked) for m in model.modules()
                   if isinstance(m, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d)]
        results[key] = {"losses": losses, "tracked": tracked,
                        "channels_last": recipe.channels_last}
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
"""


def combination(strategy: str, preset: str, optimizer: str, precision: str,
                checkpointing: bool) -> dict:  # fmt: skip
    cfg = copy.deepcopy(default_config())
    cfg.update(task="ddppipe.tasks.mnist", task_args={})
    cfg["train"].update(preset=preset, optimizer=optimizer, precision=precision,
                        activation_checkpointing=checkpointing, batch_size=16, lr=0.001,
                        channels_last=None, epochs=1)  # fmt: skip
    nodes = 2 if strategy == "hsdp" else 1  # (hsdp: replicated across 2 "nodes" of 1 rank)
    cfg["launch"].update(strategy=strategy, nnodes=nodes, nproc_per_node=2 // nodes)
    return cfg


def combinations() -> list[tuple]:
    """(strategy, preset, optimizer, precision, activation checkpointing) of every trained
    combination."""
    fast = itertools.product(STRATEGIES, ["fast"], OPTIMIZERS, PRECISIONS, CHECKPOINTING)
    reference = itertools.product(STRATEGIES, ["reference"], OPTIMIZERS, ["fp32"], [False])
    return [*fast, *reference]


def key(*values: object) -> str:
    return " ".join(map(str, values))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every combination's losses and BatchNorm counters (or its error), from one pair of ranks."""
    folder = tmp_path_factory.mktemp("combinations")
    out, ranks = folder / "results.json", folder / "ranks.py"
    ranks.write_text(RANKS)
    combos = {key(*values): combination(*values) for values in combinations()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
         str(ranks), json.dumps(combos), str(out), str(STEPS)],
        env=env, cwd=REPO, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(Path(out).read_text())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_combination_of_a_strategy_trains(trained: dict, strategy: str) -> None:
    """Each combination takes its steps with finite losses; a BatchNorm layer counts each
    batch once (activation checkpointing's recompute does not count it again)."""
    failed, counted = {}, {}
    for values in [c for c in combinations() if c[0] == strategy]:
        found = trained[key(*values)]
        if "error" in found:
            failed[key(*values)] = found["error"]
            continue
        assert len(found["losses"]) == STEPS and all(0 < x < 10 for x in found["losses"])
        counted[key(*values)] = set(found["tracked"])
    assert failed == {}
    assert len(counted) == 3 * 2 * 2 + 3
    fast = {k: v for k, v in counted.items() if " fast " in k}
    assert len(fast) == 12 and all(v == {STEPS} for v in fast.values()), fast  # 2 BatchNorms


def test_channels_last_is_the_presets_only_where_the_model_is_not_sharded(trained: dict) -> None:
    """FSDP2 shards only contiguous parameters: the fast preset's channels_last is left out
    under fsdp and hsdp, kept under ddp."""
    for strategy, shard in (("ddp", False), ("fsdp", True), ("hsdp", True)):
        assert trained[key(strategy, "fast", "adamw", "bf16", False)]["channels_last"] is not shard


def test_channels_last_asked_for_with_a_sharded_strategy_is_refused() -> None:
    cfg = combination("fsdp", "fast", "adamw", "bf16", False)
    cfg["train"]["channels_last"] = True
    with pytest.raises(config.ConfigError) as refused:
        config.resolve(cfg, gpus=False)
    assert str(refused.value) == (
        "train.channels_last: true with launch.strategy fsdp: FSDP2 shards only contiguous "
        "parameters, and channels_last makes a convolution's weights non-contiguous; set "
        "train.channels_last: false (or leave it null: the preset's value is then left out), "
        "or use launch.strategy: ddp"
    )
