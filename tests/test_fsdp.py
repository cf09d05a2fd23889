"""Sharded data parallel (launch.strategy fsdp) and sharded checkpoints that resume at another
world size: real 2-process runs (gloo, CPU) of the byte-level transformer (ddppipe.tasks.charlm),
resumed at 1 and 3 processes from their epoch-1 checkpoint."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddppipe import tasks
from ddppipe.core import slot
from ddppipe.data import manifest
from ddppipe.parallel import fsdp
from ddppipe.settings import config, run_spec
from ddppipe.training.checkpoints import checkpoint, sharded_checkpoint
from ddppipe.training.loop import evaluate
from tests.conftest import run_cli
from tests.tiny import default_config

# 40,000 bytes of Python's sources in windows of 32: 1,249 windows, 125 of them for testing,
# 1,124 for training: 24 steps an epoch of a global batch of 48 (the last one 20 samples: 7, 7
# and 6 at 3 ranks).
ARGS = {"max_bytes": 40_000, "context": 32, "d_model": 32, "layers": 2, "heads": 2}
TRAIN_SAMPLES, STEPS_PER_EPOCH = 1124, 24
E1 = "ckpt-e0001-s000000"


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("charlm")
    task = tasks.load("ddppipe.tasks.charlm")
    full = tasks.validate_args(task, dict(ARGS))
    task.call("prepare", data, full)
    manifest.write(data, task.source.as_dict(), full)
    return data


def lm_config(strategy: str, nproc: int) -> dict[str, Any]:
    """The charlm task, fp32 (so runs at different world sizes agree to rounding), 2 epochs."""
    cfg = copy.deepcopy(default_config())
    task = tasks.load("ddppipe.tasks.charlm")
    cfg.update(run="lm", task="ddppipe.tasks.charlm", task_args=tasks.validate_args(task, ARGS))
    cfg["train"].update(epochs=2, batch_size=48, eval_batch_size=64, precision="fp32",
                        channels_last=False)  # fmt: skip
    cfg["launch"].update(strategy=strategy, nproc_per_node=nproc)
    return cfg


def launch(cfg: dict[str, Any], data: Path, run_dir: Path, **run: Any) -> str:
    """Train ``cfg`` in ``run_dir``; ddppipe launch's stderr. ``run``: run_cli's options."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config.write(config.resolve(cfg, gpus=False), run_dir / "config.yaml")
    return run_cli(
        "launch", f"--config={run_dir / 'config.yaml'}", f"--data={data}",
        f"--state={run_dir / 'state'}", f"--checkpoint={run_dir / 'final.pt'}",
        f"--metrics={run_dir / 'metrics.jsonl'}", **run,
    ).stderr  # fmt: skip


def history(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(lm_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two epochs at 2 processes without interruption, with each strategy."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        runs[strategy] = tmp_path_factory.mktemp(f"straight-{strategy}")
        launch(lm_config(strategy, 2), lm_data, runs[strategy])
    return runs


@pytest.mark.slow  # the two straight runs (2 worlds)
def test_both_strategies_write_sharded_checkpoints_and_full_weights(
    straight: dict[str, Path], lm_data: Path
) -> None:
    for strategy, run_dir in straight.items():
        folder = run_dir / "state" / "checkpoints"
        stored = sharded_checkpoint.Store(folder).paths()
        assert [p.name for p in stored] == [E1, "ckpt-e0002-s000000"], strategy
        parts = sorted(p.name for p in stored[-1].iterdir())
        # every fsdp rank writes its shards; under ddp rank 0 alone the (replicated) tensors;
        # each rank its own RNG streams
        tensors = ["__0_0.distcp", "__1_0.distcp"] if strategy == "fsdp" else ["__0_0.distcp"]
        assert parts == [".metadata", "COMMITTED", *tensors, "rng-0.pt", "rng-1.pt", "state.pt"]
        final = checkpoint.load(run_dir / "final.pt")
        assert final["meta"]["strategy"] == strategy and final["meta"]["world_size"] == 2
        weights = torch.load(run_dir / "model.pt", weights_only=True)  # full, unsharded
        assert weights["blocks.0.qkv.weight"].shape == (96, 32)
        assert (
            weights.keys()
            == tasks.load("ddppipe.tasks.charlm")
            .module.model(lm_config(strategy, 2)["task_args"])
            .state_dict()
            .keys()
        )
        (attempt,) = json.loads((run_dir / "state" / "attempts.json").read_text())
        assert (attempt["world_size"], attempt["strategy"]) == (2, strategy)
    # fp32: FSDP trains the numbers DDP does, up to the order of float additions
    ddp, sharded = history(straight["ddp"]), history(straight["fsdp"])
    assert sharded[-1]["train_loss"] == pytest.approx(ddp[-1]["train_loss"], rel=1e-5)
    # evaluation of the final checkpoint in one process, as `ddppipe evaluate` does it
    spec = run_spec.load(straight["fsdp"] / "config.yaml")
    again = evaluate.evaluate_checkpoint(straight["fsdp"] / "final.pt", spec, lm_data, 64)
    reported = json.loads((straight["fsdp"] / "evaluation.json").read_text())
    assert again["test_loss"] == pytest.approx(reported["test_loss"], rel=1e-5)
    assert again["test_count"] == reported["test_count"] == 125


def leave_a_partial_save_and_an_uncommitted_checkpoint(folder: Path, name: str) -> list[Path]:
    """What a kill -9 during a later save than ``name``'s leaves in ``folder`` (a .saving
    folder), and a newer checkpoint folder without its commit marker: neither is resumed
    from. Their paths (the .saving one removed by the resume, the other moved to damaged/)."""
    epoch = name.split("-")[1]
    saving, uncommitted = folder / f"ckpt-{epoch}-s000012.saving", folder / f"ckpt-{epoch}-s000016"
    saving.mkdir()
    (saving / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(folder / name, uncommitted)
    (uncommitted / sharded_checkpoint.COMMITTED).unlink()
    return [saving, uncommitted]


def assert_left_alone(leftovers: list[Path]) -> None:
    saving, uncommitted = leftovers
    assert not saving.exists()
    assert (uncommitted.parent / "damaged" / uncommitted.name).is_dir()


# (fsdp resumed at 1 process: the mid-epoch stop below)
@pytest.mark.slow  # the straight runs, then a world
@pytest.mark.parametrize(("strategy", "world"), [("ddp", 1), ("ddp", 3), ("fsdp", 3)])
def test_a_run_stopped_at_2_processes_continues_at_1_or_3(
    straight: dict[str, Path], lm_data: Path, tmp_path: Path, strategy: str, world: int
) -> None:
    """The epoch-1 checkpoint of the 2-process run, resumed at ``world`` processes: no step
    redone, and epoch 2 trains the numbers of the uninterrupted run.

    Tolerance: fp32, the same samples in the same global batches; only the order in which
    the ranks' gradients are summed differs (none at 1 process), a relative 1e-7 a step. 1e-5
    on the loss keeps a margin of 100 over the 2e-8 measured; a step redone or skipped moves
    it by 1e-2."""
    folder = tmp_path / "state" / "checkpoints"
    shutil.copytree(straight[strategy] / "state" / "checkpoints" / E1, folder / E1)
    leftovers = leave_a_partial_save_and_an_uncommitted_checkpoint(folder, E1)

    stderr = launch(lm_config(strategy, world), lm_data, tmp_path)
    assert f"resuming from {folder / E1}" in stderr, stderr
    assert_left_alone(leftovers)
    (attempt,) = json.loads((tmp_path / "state" / "attempts.json").read_text())
    assert attempt["resumed_from"] == E1 and attempt["start_step"] == STEPS_PER_EPOCH
    assert (attempt["world_size"], attempt["strategy"]) == (world, strategy)
    assert attempt["efficiency"]["images"] == TRAIN_SAMPLES  # one epoch: no step redone
    reference, resumed = history(straight["ddp"]), history(tmp_path)
    assert resumed[0] == history(straight[strategy])[0]  # epoch 1's came with the checkpoint
    assert [m["world_size"] for m in resumed] == [2, world]
    assert resumed[1]["train_loss"] == pytest.approx(reference[1]["train_loss"], rel=1e-5)
    assert resumed[1]["test_loss"] == pytest.approx(reference[1]["test_loss"], rel=1e-5)


@pytest.mark.slow  # the straight runs, then a world
def test_a_whole_model_checkpoint_of_a_run_started_before_is_resumed_from(
    straight: dict[str, Path], lm_data: Path, tmp_path: Path
) -> None:
    """A ``ckpt-*.pt`` file (the format before sharded checkpoints, as final.pt still is): the
    ddp run resumes from it, here after its last epoch (no training, the final evaluation)."""
    folder = tmp_path / "state" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(straight["ddp"] / "final.pt", folder / "ckpt-e0002-s000000.pt")
    stderr = launch(lm_config("ddp", 1), lm_data, tmp_path)
    assert f"resuming from {folder / 'ckpt-e0002-s000000.pt'}" in stderr, stderr
    before = torch.load(straight["ddp"] / "model.pt", weights_only=True)
    after = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert history(tmp_path) == history(straight["ddp"])


# The transformer task, but rank 0 sends itself the stop signal (SIGUSR1, what SLURM sends
# before a time limit) at its STOP_AT_FORWARD-th training forward, when that is set.
STOPPING_TASK = '''\
"""The byte-level transformer; rank 0 stops itself at its STOP_AT_FORWARD-th training forward."""

from ddppipe.tasks import charlm
from ddppipe.tasks.charlm import ARGS_SCHEMA, datasets, loss, metrics, prepare  # noqa: F401
from tests.stopping import stop_at_forward


def model(args):
    return stop_at_forward(charlm.model(args))
'''


@pytest.mark.slow  # the straight runs, then 2 worlds
def test_a_run_stopped_mid_epoch_at_2_processes_continues_at_1(
    straight: dict[str, Path], lm_data: Path, tmp_path: Path
) -> None:
    """SIGUSR1 to rank 0 at its 3rd training step of epoch 1: the ranks agree on the stop at
    their next check (step 10: they check every 10 steps), checkpoint there and exit 75. The
    next slot, at 1 process, resumes at step 10 of epoch 1: no step redone (the slot trains
    the epoch's other 14 steps and epoch 2), the same samples in the same order, so the
    uninterrupted fsdp run's numbers (same tolerance as above: a redone, skipped or reordered
    step moves the loss by 1e-2).

    The stopped slot trains with launch.strategy hsdp (one node: fsdp's mesh) and activation
    checkpointing, the resumed one with fsdp and without, and a checkpoint by time at each of
    its agreements (train.checkpoint_minutes shorter than a step): none changes a number. A
    partial save and an uncommitted checkpoint newer than the stop's are left alone."""
    task = tmp_path / "stopping.py"
    task.write_text(STOPPING_TASK)
    stopped = lm_config("hsdp", 2)
    stopped.update(task=str(task))
    stopped["train"]["activation_checkpointing"] = True
    stderr = launch(stopped, lm_data, tmp_path, check=False, env={"STOP_AT_FORWARD": "3"})
    assert "ValueError" not in stderr, stderr  # rank 1, which got no signal, stops as rank 0
    mid_epoch = "ckpt-e0000-s000010"
    first = json.loads((tmp_path / "state" / "attempts.json").read_text())
    assert [a["outcome"] for a in first] == ["stopped on SIGUSR1"], first
    assert (first[0]["checkpoint"], first[0]["end_step"]) == (mid_epoch, 10)
    assert (first[0]["world_size"], first[0]["strategy"]) == (2, "hsdp")

    resumed = lm_config("fsdp", 1)
    resumed.update(task=str(task))
    resumed["train"]["checkpoint_minutes"] = 1e-6
    leftovers = leave_a_partial_save_and_an_uncommitted_checkpoint(
        tmp_path / "state" / "checkpoints", mid_epoch
    )
    stderr = launch(resumed, lm_data, tmp_path)
    assert f"resuming from {tmp_path / 'state' / 'checkpoints' / mid_epoch}" in stderr, stderr
    assert_left_alone(leftovers)
    second = json.loads((tmp_path / "state" / "attempts.json").read_text())[1]
    assert (second["resumed_from"], second["start_step"]) == (mid_epoch, 10)
    assert (second["world_size"], second["strategy"]) == (1, "fsdp")
    # the rest of epoch 1 (1,124 samples less 10 steps of 48) and epoch 2
    assert second["efficiency"]["images"] == (TRAIN_SAMPLES - 10 * 48) + TRAIN_SAMPLES
    # by time at epoch 1's step 20 and epoch 2's steps 10 and 20; 2 more at the epochs' ends
    figures = second["efficiency"]
    assert (figures["timed_checkpoints"], figures["checkpoints"]) == (3, 5)
    reference, history_ = history(straight["fsdp"]), history(tmp_path)
    assert [m["world_size"] for m in history_] == [1, 1]
    assert history_[0]["test_loss"] == pytest.approx(reference[0]["test_loss"], rel=1e-5)
    assert history_[1]["train_loss"] == pytest.approx(reference[1]["train_loss"], rel=1e-5)
    assert history_[1]["test_loss"] == pytest.approx(reference[1]["test_loss"], rel=1e-5)


# --- the blocks FSDP shards ---------------------------------------------------------------


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ModuleList([
            nn.Linear(4, 4)])) for _ in range(3)])  # fmt: skip


def test_the_blocks_are_the_outermost_module_lists_modules() -> None:
    model = Layers()
    assert fsdp.blocks(model) == list(model.layers)


def test_without_a_module_list_the_blocks_are_the_children_with_parameters() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert fsdp.blocks(model) == [model[0], model[2]]


def test_a_models_shard_blocks_names_them() -> None:
    model = Layers()
    model.shard_blocks = ["embed", "layers.1"]  # type: ignore[assignment]
    assert fsdp.blocks(model) == [model.embed, model.layers[1]]
    model.shard_blocks = ["layer.1"]  # type: ignore[assignment]
    with pytest.raises(fsdp.ShardingError, match=r"names 'layer\.1', which is not one of"):
        fsdp.blocks(model)


def test_a_model_without_blocks_is_refused_with_what_to_do() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    with pytest.raises(fsdp.ShardingError, match="give the model a shard_blocks attribute"):
        fsdp.blocks(Flat())


def test_an_unknown_strategy_is_a_config_error() -> None:
    cfg = default_config()
    cfg["launch"]["strategy"] = "zero3"
    with pytest.raises(config.ConfigError, match=r"launch.strategy: 'zero3' is not one of"):
        config.resolve(cfg, gpus=False)


# --- hybrid sharding: the mesh -------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "nnodes", "nproc", "shape"), [
    ("hsdp", 4, 8, (4, 8)),  # replicate across the 4 nodes, shard over a node's 8 ranks
    ("hsdp", 2, 1, (2, 1)),  # one rank a node: replicated only
    ("hsdp", 1, 8, (8,)),  # one node: plain fsdp
    ("fsdp", 4, 8, (32,)),  # every rank holds a shard
    ("fsdp", 1, 2, (2,)),
])  # fmt: skip
def test_the_mesh_of_each_sharded_strategy(
    strategy: str, nnodes: int, nproc: int, shape: tuple[int, ...]
) -> None:
    assert fsdp.mesh_shape(strategy, nnodes, nproc) == shape


def test_a_mesh_for_ddp_is_refused_with_what_to_do() -> None:
    with pytest.raises(fsdp.ShardingError, match=r"launch.strategy 'ddp' shards nothing: a mesh "
                       r"is for fsdp or hsdp"):  # fmt: skip
        fsdp.mesh_shape("ddp", 2, 4)


def test_hsdp_is_a_strategy_and_guessed_keys_name_the_setting() -> None:
    cfg = default_config()
    cfg["launch"]["strategy"] = "hsdp"
    assert config.resolve(cfg, gpus=False)["launch"]["strategy"] == "hsdp"
    cfg["launch"]["fsdp_hybrid"] = True
    cfg["launch"]["activation_checkpointing"] = True
    with pytest.raises(config.ConfigError) as error:
        config.resolve(cfg, gpus=False)
    assert "launch.fsdp_hybrid: no such key; set launch.strategy: hsdp" in str(error.value)
    assert ("launch.activation_checkpointing: no such key; set "
            "train.activation_checkpointing") in str(error.value)  # fmt: skip


# --- activation checkpointing ------------------------------------------------------------


def saved_bytes(layers: int, checkpointed: bool) -> tuple[int, torch.Tensor, dict[str, Any]]:
    """The bytes one forward of the transformer (batch 8 x 64 bytes, d_model 32) keeps for
    its backward, as autograd's saved-tensor hooks see them; its loss and gradients."""
    task = tasks.load("ddppipe.tasks.charlm")
    args = {"context": 64, "d_model": 32, "layers": layers, "heads": 2}
    torch.manual_seed(0)
    model = task.module.model(tasks.validate_args(task, args))
    if checkpointed:
        fsdp.checkpoint_activations(model)
    x, y = torch.randint(0, 256, (2, 8, 64), generator=torch.Generator().manual_seed(1))
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task.module.loss(model(x), y)
    loss.backward()
    return sum(kept), loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def test_activation_checkpointing_keeps_only_each_blocks_input_and_changes_no_number() -> None:
    """Checkpointed, a block keeps only its input for the backward (8 x 64 x 32 fp32: 64 KiB)
    instead of its every activation (about 18 times that here); the loss and every gradient
    are bitwise those without it (fp32 on CPU: the recomputation repeats the same arithmetic).
    The parameters keep their names (state dicts and checkpoints are unchanged)."""
    block_input = 8 * 64 * 32 * 4
    plain = {layers: saved_bytes(layers, False) for layers in (2, 4)}
    checkpointed = {layers: saved_bytes(layers, True) for layers in (2, 4)}
    assert checkpointed[4][0] - checkpointed[2][0] == 2 * block_input
    assert plain[4][0] - plain[2][0] > 2 * 10 * block_input
    assert checkpointed[4][0] < plain[4][0] / 3  # measured: 0.25
    _, loss, grads = plain[4]
    _, loss_checkpointed, grads_checkpointed = checkpointed[4]
    assert torch.equal(loss, loss_checkpointed)
    assert grads.keys() == grads_checkpointed.keys()
    assert all(torch.equal(grads[k], grads_checkpointed[k]) for k in grads)


def test_activation_checkpointing_of_a_model_without_blocks_says_what_to_do() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    with pytest.raises(fsdp.ShardingError, match=r"^train.activation_checkpointing: Flat has "
                       r"no blocks.*or set train.activation_checkpointing: false$"):  # fmt: skip
        fsdp.checkpoint_activations(Flat())


# --- job.shard(): a script's model per launch.strategy, in 2 real processes (gloo) -----------

SMALL = {"context": 8, "d_model": 16, "layers": 2, "heads": 2}
# launch.strategy, LOCAL_WORLD_SIZE (1: two nodes of one process), activation checkpointing
SCRIPT_CASES = {"hsdp-2-nodes": ("hsdp", 1, True), "hsdp-1-node": ("hsdp", 2, False),
                "fsdp": ("fsdp", 2, True), "ddp": ("ddp", 2, True)}  # fmt: skip


def small_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randint(0, 256, (2, 4, SMALL["context"]),
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    return x, y


def one_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    tasks.load("ddppipe.tasks.charlm").module.loss(net(x), y).backward()
    optimizer.step()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}  # fmt: skip


def script_rank(rank: int, folder: str) -> None:
    """One of 2 processes of a script: each case's model through job.shard(), one SGD step on
    this rank's half of the batch; rank 0 saves the full weights after it and the placements."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=2)  # fmt: skip
    from ddppipe import job

    x, y = small_batch()
    task = tasks.load("ddppipe.tasks.charlm")
    found = {}
    for name, (strategy, local, checkpointed) in SCRIPT_CASES.items():
        record = slot.Slot("lm", folder, device="cpu", strategy=strategy,
                           activation_checkpointing=checkpointed)  # fmt: skip
        os.environ.update(
            LOCAL_WORLD_SIZE=str(local),
            **slot.write(record, Path(folder, f"slot-{name}-{rank}.json")),
        )
        torch.manual_seed(0)
        net = job.shard(task.module.model(tasks.validate_args(task, SMALL)))
        one_step(net, x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        model = net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net
        weight = model.blocks[0].qkv.weight
        placements = [type(p).__name__ for p in getattr(weight, "placements", [])]
        found[name] = (type(net).__name__, placements, full_weights(model))
    if rank == 0:
        torch.save(found, f"{folder}/found.pt")
    dist.destroy_process_group()


def test_job_shard_gives_a_script_the_runs_strategy(tmp_path: Path) -> None:
    """job.shard() in 2 gloo processes: hsdp over "2 nodes of 1 process" is a 2-D mesh
    (replicated across the nodes, sharded within one), hsdp on one node is fsdp's 1-D mesh,
    ddp a DDP wrapper; every one (activation checkpointing on or off) trains the numbers of
    one process on the whole batch: one SGD step's weights within 1e-6 (fp32, only the order
    of the 2 ranks' gradient sums differs)."""
    import torch.multiprocessing as mp

    mp.spawn(script_rank, args=(str(tmp_path),), nprocs=2)
    found = torch.load(tmp_path / "found.pt", weights_only=False)
    task = tasks.load("ddppipe.tasks.charlm")
    torch.manual_seed(0)
    alone = task.module.model(tasks.validate_args(task, SMALL))
    one_step(alone, *small_batch())
    expected = full_weights(alone)
    assert {name: kind[:2] for name, kind in found.items()} == {
        "hsdp-2-nodes": ("FSDPNet", ["Replicate", "Shard"]),
        "hsdp-1-node": ("FSDPNet", ["Shard"]),
        "fsdp": ("FSDPNet", ["Shard"]),  # FSDP2 subclasses the model in place
        "ddp": ("DistributedDataParallel", []),
    }
    for name, (_, _, weights) in found.items():
        assert weights.keys() == expected.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-6, msg=name)


def test_the_launcher_tells_a_script_the_strategy(tmp_path: Path) -> None:
    from ddppipe.launching import lifecycle
    from ddppipe.runstate.attempts import Attempt
    from ddppipe.runstate.state import StateDir

    cfg = default_config()
    cfg["launch"]["strategy"], cfg["train"]["activation_checkpointing"] = "hsdp", True
    spec = run_spec.resolve(cfg, gpus=False)
    opened = Attempt(2, "local", 0, ["here"], 100.0)
    record = lifecycle.slot_record(spec, StateDir(tmp_path / "state"), opened, None, None)
    env = slot.write(record, tmp_path / "slot.json")
    found = slot.read(env)
    assert found == record and (found.strategy, found.activation_checkpointing) == ("hsdp", True)
    assert (found.attempt, found.start, found.state) == (2, 100.0, str(tmp_path / "state"))
