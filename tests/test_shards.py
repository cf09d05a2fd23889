"""Shards (``ddppipe.data.shards``): samples written once into plain tar files, streamed by the
ranks' DataLoader workers in file order; every sample once an epoch across any mix of world
sizes and worker counts, a stop mid-epoch included; nothing half-written."""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.data import batches, sharding, shards
from ddppipe.launching import resolve
from tests.conftest import prepare_in_process, run_cli
from tests.test_tasks_builtin import write_images
from tests.tiny import REPO, default_config

N = 203  # samples: not a multiple of the batch, the shards or the window


def decode(sample: shards.Sample) -> tuple[torch.Tensor, int]:
    return torch.frombuffer(bytearray(sample["x"]), dtype=torch.uint8).float(), int(sample["id"])


def write(base: Path, n: int = N, shard_bytes: int = 41 * 1024) -> None:
    """Sample i: 16 bytes of value i % 256 and its id: 20 samples a shard (2 KiB each in tar)."""
    with shards.Writer(base, shard_bytes=shard_bytes) as writer:
        for i in range(n):
            writer.write({"x": bytes([i % 256]) * 16, "id": str(i).encode()})


def test_samples_written_are_read_back_from_plain_tar_files(tmp_path: Path) -> None:
    base = tmp_path / "data" / "train"
    write(base)
    data = shards.Sharded(base, decode)
    names = sorted(p.name for p in base.parent.iterdir())
    assert names[:3] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert names[-2:] == ["train.offsets.npy", "train.shards.json"]
    assert [s["count"] for s in data.shards] == [20] * 10 + [3]
    assert len(names) == 2 + 11
    assert len(data) == N
    x, y = data[150]
    assert y == 150 and x.tolist() == [150.0] * 16
    with tarfile.open(base.parent / "train-000000.tar") as tar:  # any tar reader reads them
        assert tar.getnames()[:4] == ["000000000.id", "000000000.x", "000000001.id", "000000001.x"]
        assert tar.extractfile("000000001.id").read() == b"1"


def test_an_epochs_order_mixes_shards_within_windows_and_depends_on_seed_and_epoch(
    tmp_path: Path,
) -> None:
    write(tmp_path / "train")
    data = shards.Sharded(tmp_path / "train", decode, window=50)
    order = data.order(seed=3, epoch=1)
    assert sorted(order.tolist()) == list(range(N))
    assert torch.equal(order, data.order(3, 1))
    assert not torch.equal(order, data.order(3, 2))
    assert not torch.equal(order, data.order(4, 1))
    shard_of = torch.searchsorted(torch.as_tensor(data.starts), order, right=True) - 1
    for lo in range(0, 200, 50):  # a (full) window mixes the shards it spans
        window = shard_of[lo : lo + 50].tolist()
        assert len(set(window)) >= 2 and window != sorted(window)


def one_rank(data: Any, epoch: int, rank: int, world: int, workers: int, start: int, stop: int,
             batch: int) -> list[list[int]]:  # fmt: skip
    """The ids of the local batches rank ``rank`` trains at steps [start, stop)."""
    feed = batches.Feed(data, torch.device("cpu"), workers)
    out = []
    for share in feed.epoch(7, epoch, batch, rank, world, start):
        out.append(share.batch[1].tolist()[: share.count])  # (none of a stand-in's)
        if len(out) == stop - start:
            break
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_every_sample_once_an_epoch_when_world_size_and_workers_change_mid_epoch(
    tmp_path: Path,
) -> None:
    """Steps 0-4 at 2 ranks of 2 workers, 5-13 at 1 rank of 4, the rest at 3 ranks of 2 (real
    DataLoader workers): each global batch is the uninterrupted run's, every sample once."""
    write(tmp_path / "train")
    data = shards.Sharded(tmp_path / "train", decode, window=50)
    steps = sharding.steps_per_epoch(N, 8)  # 26
    straight = one_rank(data, 1, 0, 1, 0, 0, steps, 8)
    global_batches: list[list[int]] = []
    for world, workers, start, stop in [(2, 2, 0, 5), (1, 4, 5, 14), (3, 2, 14, steps)]:
        ranks = [one_rank(data, 1, r, world, workers, start, stop, 8) for r in range(world)]
        for parts in zip(*ranks, strict=True):
            global_batches.append([i for part in parts for i in part])
    assert global_batches == straight
    seen = Counter(i for b in global_batches for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    evaluated = [i for r in range(3) for b in batches.Feed(data, torch.device("cpu"), 2).shard(
        r, 3, 16) for i in b[1].tolist()]  # fmt: skip
    assert evaluated == list(range(N))


def test_a_worker_reads_its_samples_shard_by_shard_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "train")
    data = shards.Sharded(tmp_path / "train", decode, window=50)
    opened: list[str] = []
    real_open = open

    def counting_open(path: Any, *a: Any, **k: Any) -> Any:
        opened.append(Path(path).name)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", counting_open)
    read = data.read([150, 3, 40, 4, 151])
    assert list(read) == [3, 4, 40, 150, 151]  # ascending: forward seeks only
    assert opened == ["train-000000.tar", "train-000002.tar", "train-000007.tar"]
    opened.clear()
    # a rank alone, one worker (in this process): one epoch opens each shard about once a
    # window it falls in, not once a sample
    list(batches.Feed(data, torch.device("cpu"), 0).epoch(7, 0, 8, 0, 1, 0))
    assert len(data.shards) <= len(opened) <= 2 * len(data.shards)


def test_a_write_that_fails_leaves_no_shard_and_no_index(tmp_path: Path) -> None:
    base = tmp_path / "train"
    write(base)  # an earlier write: gone too, its data being replaced
    with pytest.raises(RuntimeError, match="disk full"), shards.Writer(base, 2048) as writer:
        for i in range(50):
            writer.write({"x": b"0" * 16, "id": str(i).encode()})
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(shards.ShardError, match=r"train.shards.json missing: no shards"):
        shards.Sharded(base, decode)


def test_samples_of_other_fields_are_refused(tmp_path: Path) -> None:
    with pytest.raises(shards.ShardError, match=r"sample 1 has fields \['id'\], the first had"
                       r" \['id', 'x'\]"), shards.Writer(tmp_path / "t") as writer:  # fmt: skip
        writer.write({"x": b"1", "id": b"0"})
        writer.write({"id": b"1"})
    assert list(tmp_path.iterdir()) == []


# --- a task that streams shards, trained, stopped and continued --------------------------

EXAMPLE = REPO / "examples" / "tasks" / "imageshards.py"
# The example, with rank 0 stopping itself at its STOP_AT_FORWARD-th training forward.
STOPPING = f"""\
import importlib.util

from tests.stopping import stop_at_forward

spec = importlib.util.spec_from_file_location("imageshards", {str(EXAMPLE)!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
ARGS_SCHEMA, PREPARE_ARGS = example.ARGS_SCHEMA, example.PREPARE_ARGS
prepare, datasets = example.prepare, example.datasets


def model(args):
    return stop_at_forward(example.model(args))
"""


@pytest.mark.slow  # 3 worlds
def test_a_task_streaming_shards_stopped_at_1_rank_of_4_workers_continues_at_2_ranks(
    tmp_path: Path,
) -> None:
    """The example task (images' bytes in shards, decoded in the workers): 1 rank of 4 workers
    stopped at step 10 of 17, continued by 2 ranks of 2 workers, whose last step holds 1 sample
    (129 images, batch 8: rank 1 trains a stand-in counted 0): the weights and the test loss
    of one uninterrupted rank (the same global batches, fp32 rounding apart)."""
    root = tmp_path / "images"
    write_images(root / "train", per_class=43)
    write_images(root / "test", per_class=8, seed=1)
    task = tmp_path / "stopping.py"
    task.write_text(STOPPING)
    cfg = default_config()
    cfg.update(run="shards", task=str(task), task_args={
        "root": str(root), "image_size": 16, "channels": 3, "shard_mb": 0.01, "window": 32,
        "width": 8})  # fmt: skip
    cfg["train"].update(epochs=1, batch_size=8, eval_batch_size=16, precision="fp32")
    settings = tmp_path / "data.yaml"
    settings.write_text(json.dumps({"task": cfg["task"], "task_args": cfg["task_args"]}))
    data = tmp_path / "data"
    prepare_in_process(settings, data)
    assert len(list(data.glob("train-*.tar"))) >= 10  # 129 images of ~0.5 KB, 10 KB shards

    def train(run: Path, nproc: int, workers: int, **env: str) -> str:
        cfg["launch"].update(nproc_per_node=nproc, loader_workers=workers)
        run.mkdir(parents=True, exist_ok=True)
        resolve.write_resolved(cfg, run / "config.yaml", gpus=False)
        return run_cli("launch", f"--config={run / 'config.yaml'}", f"--data={data}",
                       f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
                       f"--metrics={run / 'metrics.jsonl'}", check=not env,
                       env=env or None).stderr  # fmt: skip

    train(tmp_path / "straight", 1, 1)
    train(tmp_path / "run", 1, 4, STOP_AT_FORWARD="3")
    (first,) = json.loads((tmp_path / "run" / "state" / "attempts.json").read_text())
    assert (first["outcome"], first["end_step"], first["world_size"]) == (
        "stopped on SIGUSR1", 10, 1)  # fmt: skip
    train(tmp_path / "run", 2, 2)
    second = json.loads((tmp_path / "run" / "state" / "attempts.json").read_text())[1]
    assert (second["start_step"], second["world_size"]) == (10, 2)
    assert second["efficiency"]["images"] == 129 - 10 * 8
    straight, resumed = (torch.load(tmp_path / r / "model.pt", weights_only=True)
                         for r in ("straight", "run"))  # fmt: skip
    assert max((straight[k] - resumed[k]).abs().max().item() for k in straight) < 1e-5
    final = [json.loads((tmp_path / r / "metrics.jsonl").read_text().splitlines()[-1])
             for r in ("straight", "run")]  # fmt: skip
    assert final[1]["test_loss"] == pytest.approx(final[0]["test_loss"], rel=1e-5)
