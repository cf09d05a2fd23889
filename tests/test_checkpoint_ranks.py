"""A DDP checkpoint at 3 ranks (real processes, gloo, connecting lazily as launched): what
each rank copies into host memory, writes and reads, and where its RNG streams go; and the
plan of such a save at any size (:mod:`ddppipe.training.checkpoints.save_plan`)."""

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddppipe.launching import launch
from ddppipe.parallel import distributed, precision
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import checkpoint, save_plan, sharded_checkpoint
from ddppipe.training.loop import rng, run_checkpoints, strategy
from ddppipe.training.measuring import efficiency, save_costs
from tests import connections, object_exchanges
from tests.test_background_copy import assert_bitwise, cloned, model_and_optimizer, train_step
from tests.tiny import default_config

# The test model's state (model_and_optimizer): 244 float32 parameters (976 bytes), BatchNorm's
# 32 float32 running statistics and its int64 count (136), Adam's two moments (1,952) and its
# 6 float32 step counts (24).
STATE_BYTES = 976 + 136 + 1952 + 24


WORLD = 3


def save_and_resume(rank: int, folder: str) -> None:
    """(One of :data:`WORLD` processes) A ddp run's checkpoint saved, the training moved on,
    resumed from it; what this rank held, gathered, wrote and read, in ``rank<N>.pt``."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=WORLD)  # fmt: skip
    joined = connections.established()  # (the store a file: gloo's pairs alone)
    spec = run_spec.resolve(default_config(), gpus=False)  # launch.strategy: ddp
    model, optimizer = model_and_optimizer()  # (the same on both ranks)
    parts = checkpoint.Trainable(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    cpu = torch.device("cpu")
    with object_exchanges.counted() as started:  # a slot's start, as its training's
        saves = run_checkpoints.Checkpoints(
            spec, StateDir(Path(folder)),
            distributed.Context(rank, rank, WORLD, cpu, "gloo", "test", WORLD),
            strategy.of(spec.launch), parts, config_hash="abc", steps_per_epoch=10,
            record=lambda **_: None, precision=precision.for_world("fp32", cpu),
            costs=save_costs.SaveCosts(),
        )  # fmt: skip
    torch.manual_seed(100 + rank)  # this rank's own streams
    streams = rng.state(cpu)
    expected = cloned(sharded_checkpoint.tensors_of(model, optimizer))
    exchanged: list[Any] = []  # what the save's gathers carried from this rank
    gather, all_gather = dist.gather_object, dist.all_gather_object

    def gathering(obj: Any, *args: Any, **kwargs: Any) -> None:
        exchanged.append(obj)
        gather(obj, *args, **kwargs)

    def all_gathering(out: list[Any], obj: Any, *args: Any, **kwargs: Any) -> None:
        exchanged.append(obj)
        all_gather(out, obj, *args, **kwargs)

    dist.gather_object, dist.all_gather_object = gathering, all_gathering
    path = saves.save(run_checkpoints.Position(1, 0, []), wait=True)
    dist.gather_object, dist.all_gather_object = gather, all_gather
    assert path is not None
    copier = saves.store.copier
    held = copier.held_bytes if copier is not None else 0
    train_step(model, optimizer)  # the training moves on
    torch.manual_seed(7)
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    read: list[int] = []  # bytes each of this rank's reads took from the checkpoint's files
    original = FileSystemReader.read_data

    def counted(self: FileSystemReader, plan: Any, planner: Any) -> Any:
        read.append(sum(self.storage_data[item.storage_index].length for item in plan.items))
        return original(self, plan, planner)

    FileSystemReader.read_data = counted  # type: ignore[method-assign]
    at = saves.resume()
    assert at is not None and (at.epoch, at.step) == (1, 0)
    assert_bitwise(sharded_checkpoint.tensors_of(model, optimizer), expected)
    assert torch.equal(torch.get_rng_state(), streams["cpu"])
    if copier is not None:
        copier.shut()
    with object_exchanges.counted() as ended:  # the slot's figures, at its end
        efficiency.SlotMeter().collect(WORLD)
    found = {"held": held, "exchanged": [type(x).__name__ for x in exchanged], "read": read,
             "files": sorted(os.listdir(path)) if rank == 0 else [], "started": dict(started),
             "ended": dict(ended), "hosts": saves.meta["hosts"],
             "joined": joined}  # fmt: skip
    torch.save(found, Path(folder) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_a_ddp_save_is_copied_written_and_read_by_rank_0_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 alone holds the state in host memory and writes it (one tensor file); each rank
    writes its own RNG streams (no object gathered: a byte a rank says they are written, a
    number a rank whether the save failed); at the resume rank 0 alone reads the tensor file,
    once, and the other rank gets the state by broadcast; every rank resumes the weights and
    its own streams. At the slot's start and end the ranks' hosts, precision and figures go
    to rank 0 alone (gathered, not all-gathered: at 16,384 ranks an all-gather of host names
    moved 16,384 of them to every rank). The ranks run in the environment the launcher gives
    its ranks: gloo connects a pair at its first use, none as the group is made (a full mesh
    would connect each of the 3 to the 2 others at once)."""
    import torch.multiprocessing as mp

    for key, value in launch.process_environment(1, {}).items():
        monkeypatch.setenv(key, value)  # (the spawned ranks')
    mp.spawn(save_and_resume, args=(str(tmp_path),), nprocs=WORLD)
    found = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [f["joined"] for f in found] == [0, 0, 0]
    assert [f["held"] for f in found] == [STATE_BYTES, 0, 0]
    assert found[0]["files"] == [".metadata", "COMMITTED", "__0_0.distcp", "rng-0.pt",
                                 "rng-1.pt", "rng-2.pt", "state.pt"]  # fmt: skip
    assert [f["exchanged"] for f in found] == [[], [], []]
    tensors = tmp_path / "checkpoints" / "ckpt-e0001-s000000" / "__0_0.distcp"
    assert [f["read"] for f in found] == [[tensors.stat().st_size], [], []]
    # per-rank metadata to rank 0 alone, which uses it: no rank receives every rank's
    assert [f["started"] for f in found] == [
        {"gather_object": 2, "gather_object:received": 6,  # precision's, the hosts
         "broadcast_object_list": 1, "broadcast_object_list:received": 1},  # the decision
        *[{"gather_object": 2, "gather_object:received": 0,
           "broadcast_object_list": 1, "broadcast_object_list:received": 1}] * 2,
    ]  # fmt: skip
    assert [f["hosts"] for f in found] == [[socket.gethostname()] * 3, [], []]
    assert [f["ended"] for f in found] == [
        {"gather_object": 1, "gather_object:received": 3},
        *[{"gather_object": 1, "gather_object:received": 0}] * 2,
    ]


@pytest.mark.parametrize(
    ("nodes", "ranks", "files", "busiest_node_files", "pinned_node_0", "pinned_others"),
    [
        (1, 2, 6, 6, 1, 0),
        (1, 3, 7, 7, 1, 0),  # the test above
        (1, 8, 12, 12, 1, 0),
        (64, 8, 516, 12, 1, 0),
        (2048, 8, 16388, 12, 1, 0),
    ],
)
def test_a_ddp_saves_plan(
    nodes: int, ranks: int, files: int, busiest_node_files: int, pinned_node_0: int,
    pinned_others: int,
) -> None:  # fmt: skip
    """Files a save writes (the job's; the busiest node's) and the state's copies a node holds
    in host memory: once a job, where every rank held one before."""
    plan = save_plan.ddp(nodes, ranks, state_bytes=1000)
    assert (plan.files, plan.busiest_node_files) == (files, busiest_node_files)
    assert plan.writers == 1
    assert plan.pinned_bytes_node_0 == pinned_node_0 * 1000
    assert plan.pinned_bytes_other_nodes == pinned_others * 1000


@pytest.mark.usefixtures("one_rank")
def test_a_rank_whose_streams_cannot_be_read_is_reseeded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint's weights resume; the rank's dropout stream starts from its seed (the
    run's, the epoch, its rank), as at another world size, and a warning names the file."""
    spec = run_spec.resolve(default_config(), gpus=False)
    model, optimizer = model_and_optimizer()
    parts = checkpoint.Trainable(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    cpu = torch.device("cpu")
    saves = run_checkpoints.Checkpoints(
        spec, StateDir(tmp_path), distributed.Context(0, 0, 1, cpu, "gloo", "test", 1),
        strategy.of(spec.launch), parts, config_hash="abc", steps_per_epoch=10,
        record=lambda **_: None, precision=precision.Decision("fp32", "fp32"),
        costs=save_costs.SaveCosts(),
    )  # fmt: skip
    path = saves.save(run_checkpoints.Position(2, 0, []), wait=True)
    assert path is not None
    (path / "rng-0.pt").write_bytes(b"torn")
    torch.manual_seed(123)  # (the stream moved on)
    assert saves.resume() is not None
    resumed = torch.get_rng_state()
    torch.manual_seed(rng.rank_seed(spec.train.seed, 2, 0))  # epoch 2's seed of rank 0
    assert torch.equal(resumed, torch.get_rng_state())
    assert f"{path / 'rng-0.pt'} unreadable" in caplog.text
    assert saves.store.copier is not None
    saves.store.copier.shut()
