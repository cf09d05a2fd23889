"""Reading a task's data: a folder of images packed once (``imagefolder``'s ``pack: true``,
``ddppipe.data.packed``): the same tensors as the loose images, read in batches from one file,
prepared again only for what changed, never half written; a two-rank training that opens no
image; and a training whose loader is slow, named data-bound."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ddppipe import tasks
from ddppipe.cli.commands import training as training_command
from ddppipe.core import nodelock, private
from ddppipe.data import batches, file_digests, manifest, packed, staging
from ddppipe.launching import resolve
from ddppipe.reports import waste
from ddppipe.tasks import imagefolder
from tests import small_disk
from tests.conftest import prepare_in_process, run_cli
from tests.test_tasks_builtin import write_images
from tests.tiny import default_config

IMAGEFOLDER = tasks.load("ddppipe.tasks.imagefolder")


def args_of(root: Path, **args: Any) -> dict[str, Any]:
    return tasks.validate_args(IMAGEFOLDER, {"root": str(root), "image_size": 8, **args})


def prepared(caplog: pytest.LogCaptureFixture, data: Path, args: dict[str, Any]) -> str:
    """Prepare ``data``; the task's line of what it read and decoded."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddppipe.tasks.imagefolder"):
        imagefolder.prepare(data, args)
    (line,) = [r.getMessage() for r in caplog.records if "decoded into packs" in r.getMessage()]
    return line.split(": ", 1)[1].removesuffix(" into packs")


@pytest.mark.parametrize("channels", [1, 3])
def test_a_pack_gives_the_tensors_the_loose_images_give(channels: int, tmp_path: Path) -> None:
    write_images(tmp_path / "images", per_class=7)
    loose_args = args_of(tmp_path / "images", channels=channels)
    imagefolder.prepare(tmp_path / "loose", loose_args)
    imagefolder.prepare(tmp_path / "packed", {**loose_args, "pack": True})
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == [
        ".cache", "index.json", "test.labels.npy", "test.npy", "train.labels.npy", "train.npy",
    ]  # fmt: skip
    assert np.load(tmp_path / "packed" / "train.npy").shape == (18, channels, 8, 8)
    loose = imagefolder.datasets(tmp_path / "loose", loose_args)
    packs = imagefolder.datasets(tmp_path / "packed", {**loose_args, "pack": True})
    for a, b in zip(loose, packs, strict=True):
        assert len(a) == len(b) in (18, 3)  # round(7 * 0.2) = 1 test image per class
        x_loose, y_loose = next(iter(DataLoader(a, batch_size=len(a))))
        x_packed, y_packed = b.batch(range(len(b)))
        assert x_packed.dtype == torch.float32 and x_packed.shape == (len(a), channels, 8, 8)
        assert torch.equal(x_packed, x_loose) and torch.equal(y_packed, y_loose)
    # A batch in any order: the rows are read in ascending order, returned in the batch's.
    x, y = packs[0].batch([9, 2, 14, 2])
    assert torch.equal(x, torch.stack([packs[0][i][0] for i in (9, 2, 14, 2)]))
    assert y.tolist() == [packs[0][i][1].item() for i in (9, 2, 14, 2)]


def test_a_rank_reads_a_pack_in_batches_through_its_workers(tmp_path: Path) -> None:
    write_images(tmp_path / "images", per_class=10)
    args = args_of(tmp_path / "images", pack=True)
    imagefolder.prepare(tmp_path / "data", args)
    train, _ = imagefolder.datasets(tmp_path / "data", args)
    cpu = torch.device("cpu")
    epoch = [share.batch for share in batches.Feed(train, cpu, workers=2).epoch(3, 1, 8, 1, 2, 0)]
    alone = [share.batch for share in batches.Feed(train, cpu, workers=0).epoch(3, 1, 8, 1, 2, 0)]
    assert [tuple(x.shape) for x, _ in epoch] == [(4, 3, 8, 8)] * 3  # 24 images, batch 8 / 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(epoch, alone, strict=True))  # fmt: skip
    # every image of the epoch once across both ranks (rank 1 above, rank 0 here)
    other = [s.batch[1] for s in batches.Feed(train, cpu, 1).epoch(3, 1, 8, 0, 2, 0)]
    seen = torch.cat([y for _, y in epoch] + other)
    assert sorted(seen.tolist()) == sorted(train.labels.tolist())


def test_only_new_or_changed_images_are_read_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = tmp_path / "images", tmp_path / "data"
    write_images(root, per_class=10)
    args = args_of(root, pack=True)
    assert prepared(caplog, data, args) == "30 image(s), 30 read (new or changed), 30 decoded"
    index = (data / "index.json").stat().st_mtime_ns
    stats = data / ".cache" / "file-digests"
    kept = {p.name: p.stat().st_mtime_ns for p in stats.iterdir()}
    assert len(kept) == 3  # one a class folder
    reads: list[str] = []
    digest = imagefolder._digest
    monkeypatch.setattr(imagefolder, "_digest", lambda p: reads.append(p.name) or digest(p))
    assert prepared(caplog, data, args) == "30 image(s), 0 read (new or changed), 0 decoded"
    assert (data / "index.json").stat().st_mtime_ns == index  # nothing rewritten
    assert reads == [] and {p.name: p.stat().st_mtime_ns for p in stats.iterdir()} == kept

    os.utime(root / "red" / "003.png", ns=(1, 1))  # touched: read, same digest, not decoded
    assert prepared(caplog, data, args) == "30 image(s), 1 read (new or changed), 0 decoded"
    assert reads == ["003.png"]
    # Only the red folder's stat cache is written again.
    assert [k for k, v in kept.items() if (stats / k).stat().st_mtime_ns != v] == [
        file_digests._file("red")
    ]
    changed = np.full((16, 16, 3), 7, dtype=np.uint8)
    Image.fromarray(changed).save(root / "green" / "004.png")
    assert prepared(caplog, data, args) == "30 image(s), 1 read (new or changed), 1 decoded"
    assert reads == ["003.png", "004.png"]
    index = json.loads((data / "index.json").read_text())
    train = [im["path"] for im in index["images"] if im["split"] == "train"]
    test = [im["path"] for im in index["images"] if im["split"] == "test"]
    split, row = ("train", train.index("green/004.png")) if "green/004.png" in train else (
        "test", test.index("green/004.png"))  # fmt: skip
    assert (packed.rows(data / split)[row] == 7).all()  # the new image, decoded

    (root / "blue" / "005.png").unlink()  # removed: out of the index
    Image.fromarray(changed).save(root / "blue" / "new.png")  # one more: the split moves
    line = prepared(caplog, data, args)
    assert line == "30 image(s), 1 read (new or changed), 1 decoded"
    assert reads[-1:] == ["new.png"]
    index = json.loads((data / "index.json").read_text())
    assert "blue/005.png" not in {im["path"] for im in index["images"]}
    fresh = tmp_path / "fresh"  # the same packs as a prepare from nothing
    imagefolder.prepare(fresh, args)
    for name in ("train.npy", "test.npy", "train.labels.npy", "test.labels.npy", "index.json"):
        assert (data / name).read_bytes() == (fresh / name).read_bytes(), name
    # The stat cache is no data: the manifest leaves it out.
    assert set(manifest.build(data, {}, {})["files"]) == {
        "index.json", "test.labels.npy", "test.npy", "train.labels.npy", "train.npy",
    }  # fmt: skip
    shutil.rmtree(root / "green")  # a class folder gone: its stat cache goes too
    imagefolder.prepare(data, {**args, "pack": False})  # unpacked: the packs go
    assert sorted(p.name for p in data.iterdir()) == [".cache", "index.json"]
    assert len(list(stats.iterdir())) == 2


def test_an_image_changed_in_place_is_read_and_checked_again(tmp_path: Path) -> None:
    """The same size, its folder's mtime kept (no folder is skipped whole): still read."""
    root, data = tmp_path / "images", tmp_path / "data"
    write_images(root, per_class=3)
    imagefolder.prepare(data, args_of(root))
    broken = bytearray((root / "blue" / "001.png").read_bytes())
    broken[40] ^= 0xFF
    folder_times = (root / "blue").stat()
    (root / "blue" / "001.png").write_bytes(bytes(broken))
    os.utime(root / "blue", ns=(folder_times.st_atime_ns, folder_times.st_mtime_ns))
    with pytest.raises(imagefolder.ImageFolderError, match=r"001\.png is not a readable image"):
        imagefolder.prepare(data, args_of(root))


def counted_files(root: Path, contents: dict[str, str]) -> tuple[list[str], Any]:
    """Files ``contents`` written under ``root``; the list of files read, and a digest function
    (the content stands for the digest) that appends each file it reads to it."""
    for rel, text in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    reads: list[str] = []

    def digest(path: Path) -> str:
        reads.append(path.relative_to(root).as_posix())
        return path.read_text()

    return reads, digest


def test_file_digests_read_only_what_changed(tmp_path: Path) -> None:
    root, cache = tmp_path / "files", tmp_path / "cache"
    reads, digest = counted_files(root, {"a/1": "one", "a/2": "two", "a/3": "six", "b/1": "ten"})

    def digests(groups: dict[str, list[str]]) -> tuple[list[str], int]:
        reads.clear()
        return file_digests.digests(root, list(groups.items()), cache, digest, workers=2)

    groups = {"a": ["a/1", "a/2", "a/3"], "b": ["b/1"]}
    assert digests(groups) == (["one", "two", "six", "ten"], 4)
    assert digests(groups) == (["one", "two", "six", "ten"], 0) and reads == []
    (root / "a/2").write_text("TWO")  # the same size; its mtime set apart from the others'
    os.utime(root / "a/2", ns=(10**9, 10**9))
    assert digests(groups) == (["one", "TWO", "six", "ten"], 1) and reads == ["a/2"]
    (cache / "file-digests" / file_digests._file("b")).write_bytes(b"{}\nbroken")
    assert digests(groups) == (["one", "TWO", "six", "ten"], 1) and reads == ["b/1"]
    (root / "a/3").unlink()  # a file and a group gone: their entries go
    assert digests({"a": ["a/1", "a/2"]}) == (["one", "TWO"], 0)
    assert [p.name for p in (cache / "file-digests").iterdir()] == [file_digests._file("a")]
    (root / "a/3").write_text("new")
    assert digests({"a": ["a/1", "a/2", "a/3"]}) == (["one", "TWO", "new"], 1)


def test_file_digests_name_the_files_changed_since_their_record(tmp_path: Path) -> None:
    """What training checks (file_digests.changed): a file whose size and mtime are the
    record's is not read; one whose mtime moved is read and named if its content differs; a
    group without a record (no cache) is read whole."""
    root, cache = tmp_path / "files", tmp_path / "cache"
    reads, digest = counted_files(root, {"a/1": "one", "a/2": "two", "b/1": "ten"})
    groups = [("a", ["a/1", "a/2"]), ("b", ["b/1"])]
    file_digests.digests(root, groups, cache, digest, workers=2)  # prepare's record
    reads.clear()
    expected = ["one", "two", "ten"]
    assert file_digests.changed(root, groups, cache, expected, digest) == ([], 0)
    assert reads == []
    os.utime(root / "a/1", ns=(10**9, 10**9))  # touched: read, the same content
    (root / "b/1").write_text("TEN")  # the same size, another content, its mtime moved
    os.utime(root / "b/1", ns=(2 * 10**9, 2 * 10**9))
    assert file_digests.changed(root, groups, cache, expected, digest) == (["b/1"], 2)
    assert sorted(reads) == ["a/1", "b/1"]
    for path in (cache / "file-digests").iterdir():
        path.unlink()
    reads.clear()
    assert file_digests.changed(root, groups, cache, expected, digest) == (["b/1"], 3)


def test_a_pack_interrupted_leaves_nothing_half_written(tmp_path: Path) -> None:
    def decode(i: int) -> np.ndarray:
        if i == 5000:
            raise OSError("disk full")
        return np.full((1, 2, 2), i % 256, dtype=np.uint8)

    with pytest.raises(OSError, match="disk full"):
        packed.write(tmp_path / "train", (1, 2, 2), [0] * 6000, decode)
    assert list(tmp_path.iterdir()) == []
    assert (
        packed.write(tmp_path / "train", (1, 2, 2), [1] * 6000, lambda i: decode(i % 5000)) == 6000
    )
    assert packed.rows(tmp_path / "train")[4999].tolist() == [[[135, 135], [135, 135]]]


def test_a_pack_of_other_settings_is_refused(tmp_path: Path) -> None:
    write_images(tmp_path / "images", per_class=4)
    args = args_of(tmp_path / "images", pack=True)
    imagefolder.prepare(tmp_path / "data", args)
    with pytest.raises(imagefolder.ImageFolderError, match="written for other task_args"):
        imagefolder.datasets(tmp_path / "data", {**args, "image_size": 16})
    (tmp_path / "images" / "violet").mkdir()
    with pytest.raises(
        imagefolder.ImageFolderError, match="classes are now blue, green, red, violet"
    ):
        imagefolder.datasets(tmp_path / "data", args)


@pytest.mark.slow  # 2 worlds of 2 ranks
def test_two_ranks_train_on_a_pack_staged_once_a_node(tmp_path: Path) -> None:
    """`ddppipe prepare` packs; the images are then removed (their class folders stay): two
    ranks train and evaluate on the pack alone, staged to a node-local folder by one of them;
    a second run on the node reads the staged copy (the shared one's pack removed)."""
    root = tmp_path / "images"
    write_images(root, per_class=16)
    cfg = default_config()
    cfg.update(
        run="packed",
        task="ddppipe.tasks.imagefolder",
        task_args={"root": str(root), "image_size": 16, "width": 8, "pack": True},
    )
    cfg["train"].update(epochs=2, batch_size=8, eval_batch_size=16, precision="fp32")
    cfg["launch"]["stage_data"] = "$STAGE_HERE/stage"
    settings = tmp_path / "data.yaml"
    settings.write_text(json.dumps({"task": cfg["task"], "task_args": cfg["task_args"]}))
    data = tmp_path / "data"
    prepare_in_process(settings, data)
    for image in root.glob("*/*.png"):
        image.unlink()
    node = {"STAGE_HERE": str(tmp_path / "node-local")}

    def train(run: Path) -> str:
        resolve.write_resolved(cfg, run / "config.yaml", gpus=False)  # task_args checked
        return run_cli("launch", f"--config={run / 'config.yaml'}", f"--data={data}",
                       f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
                       f"--metrics={run / 'metrics.jsonl'}", env=node).stderr  # fmt: skip

    log = train(tmp_path / "run")
    digest = json.loads((data / "manifest.json").read_text())["digest"]
    staged = tmp_path / "node-local" / "stage" / f"ddppipe-{os.getuid()}" / f"data-{digest}"
    # (rank 0's log: the copy is rank 0's, or rank 1's when it took the node's lock first)
    copied = f"staged {data} into {staged} (5 file(s),"
    assert copied in log or f"the data staged on this node before: {staged}" in log, log
    assert sorted(p.name for p in staged.iterdir()) == [
        "index.json", "manifest.json", "test.labels.npy", "test.npy", "train.labels.npy",
        "train.npy",
    ]  # fmt: skip
    # one copy: no other folder, no temporary one left by a second copier
    assert sorted(p.name for p in staged.parent.iterdir()) == [f".{staged.name}.lock", staged.name]
    epochs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["epoch"], m["world_size"]) for m in epochs] == [(1, 2), (2, 2)]
    assert epochs[-1]["test_accuracy"] > 0.5  # three colours, 36 training images
    (slot,) = json.loads((tmp_path / "run" / "state" / "attempts.json").read_text())
    assert slot["efficiency"]["stage_s"] > 0

    (data / "train.npy").unlink()  # the second run reads the node's copy only
    log = train(tmp_path / "again")
    assert "staged" not in log.replace("staged on this node before", ""), log
    assert f"the data staged on this node before: {staged}" in log, log


def test_staging_checks_what_it_copies_and_leaves_nothing_half_done(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"a" * 3_000_000)
    (data / "b.bin").write_bytes(b"b" * 10)
    found = manifest.write(data, {"ref": "t"}, {})
    beats: list[int] = []
    dest, copied = staging.staged(data, str(tmp_path / "local"), found, lambda: beats.append(1))
    assert copied and (dest / "a.bin").read_bytes() == b"a" * 3_000_000 and beats
    assert staging.staged(data, str(tmp_path / "local"), found, lambda: None) == (dest, False)

    (data / "b.bin").write_bytes(b"c" * 10)  # changed after prepare: refused, nothing kept
    with pytest.raises(manifest.ManifestError, match=r"b\.bin changed since it was prepared"):
        staging.staged(data, str(tmp_path / "other"), found, lambda: None)
    assert os.listdir(tmp_path / "other" / dest.parent.name) == [f".{dest.name}.lock"]

    with small_disk.tmpfs(tmp_path / "small", "1m") as small:  # a node-local disk too small
        with pytest.raises(staging.StageError, match=r"\(0\.00 GB\) does not fit in .*small"):
            staging.staged(data, str(small), found, lambda: None)
        assert os.listdir(small / dest.parent.name) == [f".{dest.name}.lock"]
    with pytest.raises(staging.StageError, match=r"\$NOWHERE_SET is not set on"):
        staging.folder("$NOWHERE_SET/stage")


def test_a_data_folder_and_its_staged_copy_are_checked_alike(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (data / name).write_bytes(name.encode() * 4)
    found = manifest.write(data, {"ref": "t"}, {})
    assert manifest.check(data) == found
    dest, _ = staging.staged(data, str(tmp_path / "local"), found, lambda: None)
    (dest / "b.bin").write_bytes(b"short")  # the staged copy: sizes checked, staged again
    with caplog.at_level(logging.WARNING):
        assert staging.staged(data, str(tmp_path / "local"), found, lambda: None) == (dest, True)
    assert f"{dest} (staged before): b.bin changed since it was prepared: staging it" in caplog.text
    assert (dest / "b.bin").read_bytes() == b"b.bin" * 4

    (data / "a.bin").unlink()
    (data / "c.bin").write_bytes(b"C" * 20)  # the same size, other bytes
    assert manifest.differences(data, found, hashes=False) == [("a.bin", "missing")]
    assert manifest.differences(data, found) == [
        ("a.bin", "missing"), ("c.bin", "changed since it was prepared"),
    ]  # fmt: skip
    with pytest.raises(manifest.ManifestError) as error:
        manifest.check(data)
    assert str(error.value) == (
        f"{data} does not match its manifest.json: a.bin: missing; c.bin: changed since it was "
        f"prepared. Delete {data}/manifest.json and run the prepare_data rule again"
    )


def test_a_rank_stats_the_files_prepared_long_ago_and_hashes_only_those_whose_mtime_moved(
    tmp_path: Path,
) -> None:
    """A data folder larger than a node's disk must not be read by each rank before training:
    a file older than 2 s when the manifest was written is checked by size and mtime; a file
    written just before (its mtime could stay within one clock tick) is hashed every time."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("old.bin", "new.bin"):
        (data / name).write_bytes(b"x" * 100)
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(data / "old.bin", ns=(hour_ago, hour_ago))
    found = manifest.write(data, {"ref": "t"}, {})
    assert found["files"]["old.bin"] == {"bytes": 100, "sha256": found["files"]["old.bin"][
        "sha256"], "mtime_ns": hour_ago}  # fmt: skip
    assert "mtime_ns" not in found["files"]["new.bin"]
    for name in ("old.bin", "new.bin"):  # the same size, other bytes, the mtime put back
        before = (data / name).stat().st_mtime_ns
        (data / name).write_bytes(b"y" * 100)
        os.utime(data / name, ns=(before, before))
    # old.bin is not read (stat-ed as prepared); new.bin is, and differs
    assert manifest.differences(data, found) == [("new.bin", "changed since it was prepared")]
    (data / "old.bin").write_bytes(b"z" * 100)  # its mtime moves: read, and differs
    assert manifest.differences(data, found) == [
        ("new.bin", "changed since it was prepared"), ("old.bin", "changed since it was prepared"),
    ]  # fmt: skip


SLOW_TASK = """
import time

import torch
from torch import nn
from torch.utils.data import Dataset


class Slow(Dataset):
    def __len__(self):
        return 160

    def __getitem__(self, i):
        time.sleep(0.05)  # a slow filesystem's read
        return torch.full((4,), float(i % 2)), i % 2


def prepare(data_dir, args):
    (data_dir / "nothing.txt").write_text("the data is made up")


def datasets(data_dir, args):
    return Slow(), Slow()


def model(args):
    return nn.Linear(4, 2)
"""


def test_a_training_whose_loader_is_slow_is_named_data_bound(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each item takes 50 ms and the one rank has one DataLoader worker: a step of 4 items
    waits about 200 ms for them against a few milliseconds of compute (40 steps). One rank,
    not two: on a loaded 2-core machine two ranks' all-reduce could take as long as the read
    (a run in CI saw a 3% share with two ranks and 30 ms items)."""
    (tmp_path / "slow.py").write_text(SLOW_TASK)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "nothing.txt").write_text("the data is made up")
    manifest.write(tmp_path / "data", {"ref": "slow"}, {})
    cfg = default_config()
    cfg.update(run="slow", task=str(tmp_path / "slow.py"), task_args={})
    cfg["launch"].update(loader_workers=1, nproc_per_node=1)
    cfg["train"].update(epochs=1, batch_size=4, eval_batch_size=64, precision="fp32",
                        channels_last=False)  # fmt: skip
    run = tmp_path / "run"
    resolve.write_resolved(cfg, run / "config.yaml", gpus=False)
    run_cli("launch", f"--config={run / 'config.yaml'}", f"--data={tmp_path / 'data'}",
            f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
            f"--metrics={run / 'metrics.jsonl'}")  # fmt: skip
    (slot,) = json.loads((run / "state" / "attempts.json").read_text())
    share = slot["efficiency"]["data_wait_share"]
    assert 0.5 < share <= 1.0, slot["efficiency"]
    (flag,) = [f for f in waste.flags(slot, None, None, 2) if f.startswith("data:")]
    assert flag.startswith(f"data: the steps waited {share:.0%} of the training")
    assert flag.endswith("`ddppipe time-loader` times the loader alone")
    # the loader alone, as the flag says (`ddppipe time-loader --steps=5`'s function, in this
    # process, its output captured at the file descriptors: the loader's workers register
    # their stack dumps on stderr's): one worker reads an item in 50 ms or more
    capfd.readouterr()
    assert training_command.time_loader(run / "config.yaml", tmp_path / "data", 5, None, 0) == 0
    line = capfd.readouterr().out
    found = re.fullmatch(
        r"loader of rank 0 of 1 \(1 DataLoader worker\(s\)\): 5 batches, 20 samples; first "
        r"batch after (\d+\.\d\d) s, then (\d+) samples/s \((\d+\.\d) ms a batch\): a "
        r"training step shorter than that waits for its data\n", line)  # fmt: skip
    assert found, line
    first, per_batch = float(found[1]), float(found[3]) / 1000
    # one worker, 4 items of 50 ms a batch: the 5th batch comes 1 s after the start at the
    # earliest; the rate is read from the 1st batch on, so a 1st batch received late makes it
    # a little faster than 200 ms a batch (199.2 and 199.8 ms seen on a loaded machine)
    assert first + 4 * per_batch >= 0.99 and per_batch >= 0.15, line


# -- node-local folders another user shares (ddppipe.core.private, ddppipe.core.nodelock) ----

NOBODY = 65534  # the user nobody, and its group nogroup
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
# Run as nobody: each argument `path=content` a file (a folder where content is empty and
# path ends with /, a link where content starts with ->), every folder made mode 0777.
PLANT = r"""
import os, sys
for arg in sys.argv[1:]:
    path, content = arg.split("=", 1)
    if content.startswith("->"):
        os.symlink(content[2:], path)
        continue
    folder = path if path.endswith("/") else os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o777)
    if not path.endswith("/"):
        open(path, "w").write(content)
"""
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="acts as the user nobody (root only)")


def plant(*files: str) -> None:
    """What the user nobody plants (:data:`PLANT`)."""
    subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", PLANT, *files], check=True,
                   cwd="/", timeout=60)  # fmt: skip


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A node-local folder every user may write to, sticky (as /tmp is)."""
    folder = Path(tempfile.mkdtemp(prefix="ddppipe-test-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@contextlib.contextmanager
def held_by_nobody(lock: Path) -> Iterator[None]:
    """The lock file ``lock`` held by the user nobody (flock) in the block."""
    holder = subprocess.Popen([*AS_NOBODY, "flock", "-o", str(lock), "sh", "-c", "echo held; "
                               "exec sleep 120"], stdout=subprocess.PIPE, text=True, cwd="/",
                              start_new_session=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def data_of(folder: Path, **files: bytes) -> dict[str, Any]:
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return manifest.write(folder, {"ref": "t"}, {})


@needs_root
def test_a_stage_folder_another_user_planted_is_avoided_unread_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nobody plants this user's folder name in a shared stage folder, with a copy of the
    data of the same sizes and manifest (other bytes) and the lock held, and the next name
    as a link to it: neither is used nor read, a warning names them, no wait; where no name
    is left, or the stage folder lets others rename its entries, the staging is refused."""
    found = data_of(tmp_path / "data", **{"a.bin": b"a" * 100, "b.bin": b"b" * 10})
    name = f"data-{found['digest']}"
    with shared_folder() as shared:
        theirs, link = shared / "ddppipe-0", shared / "ddppipe-0.1"
        plant(f"{theirs}/{name}/a.bin={'x' * 100}", f"{theirs}/{name}/b.bin={'y' * 10}",
              f"{theirs}/{name}/manifest.json={(tmp_path / 'data/manifest.json').read_text()}",
              f"{theirs}/.{name}.lock=", f"{link}=->{theirs}")  # fmt: skip
        started = time.monotonic()
        with held_by_nobody(theirs / f".{name}.lock"), caplog.at_level(logging.WARNING):
            dest, copied = staging.staged(tmp_path / "data", str(shared), found, lambda: None)
        assert time.monotonic() - started < 10  # (no wait for nobody's lock)
        assert (dest, copied) == (shared / "ddppipe-0.2" / name, True)
        assert (dest / "a.bin").read_bytes() == b"a" * 100  # ours, not nobody's
        assert stat.filemode(dest.parent.stat().st_mode) == "drwx------"
        assert (
            f"{theirs} (drwxrwxrwx) is owned by nobody (uid 65534), not by this user "
            f"(root (uid 0)); {link} is a symbolic link ({theirs}), no folder of this user's: "
            f"not used (nothing in it read); using {shared}/ddppipe-0.2 instead"
        ) in caplog.text
        assert (theirs / name / "a.bin").read_text() == "x" * 100  # nothing of theirs touched

        monkeypatch.setattr(private, "TRIES", 2)
        with pytest.raises(private.NotPrivate) as refused:
            staging.staged(tmp_path / "data", str(shared), found, lambda: None)
        assert str(refused.value).startswith(
            f"no private folder of this user's can be made in {shared}: {theirs} (drwxrwxrwx) "
            "is owned by nobody (uid 65534), not by this user (root (uid 0)); "
        )
        assert "Remove them (their owner or an administrator can)" in str(refused.value)
    unsafe = tmp_path / "unsafe"
    unsafe.mkdir(mode=0o777)
    unsafe.chmod(0o777)  # writable by all, not sticky: anyone may rename our folder away
    with pytest.raises(private.NotPrivate, match=re.escape(
        f"{unsafe} (drwxrwxrwx, owned by root (uid 0)) lets other users rename what it holds"
    )):  # fmt: skip
        staging.staged(tmp_path / "data", str(unsafe), found, lambda: None)


def test_a_killed_copys_leftovers_are_removed_and_an_incomplete_copy_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy killed half-way leaves its temporary folder; the next process on the node
    removes it (and those of other data nobody is copying), stages the data and, its copy
    later found without its manifest (written last), stages it again."""
    found = data_of(tmp_path / "data", **{"a.bin": b"a" * 5_000_000, "b.bin": b"b" * 10})
    local = tmp_path / "local"
    copier = subprocess.Popen([sys.executable, "-c", KILLED_COPY, str(tmp_path / "data"),
                               str(local)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert copier.stdout is not None and copier.stdout.readline() == "copying\n"
    copier.kill()
    copier.wait()
    mine = local / f"ddppipe-{os.getuid()}"
    name = f"data-{found['digest']}"
    left = mine / f".{name}.{copier.pid}.tmp"
    assert (left / "a.bin").stat().st_size == 4 << 20  # one chunk copied when killed
    (mine / ".data-other.4242.tmp").mkdir()  # a copy of other data, killed too
    (mine / ".data-busy.4243.tmp").mkdir()  # one still under way (its lock held)
    busy = os.open(mine / ".data-busy.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(busy, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.INFO):
            dest, copied = staging.staged(tmp_path / "data", str(local), found, lambda: None)
    finally:
        os.close(busy)
    assert (dest, copied) == (mine / name, True)
    assert f"removing {left}, left by a process that ended before it was complete" in caplog.text
    kept = [".data-busy.4243.tmp", ".data-busy.lock", ".data-other.lock", f".{name}.lock", name]
    assert sorted(os.listdir(mine)) == sorted(kept)

    (dest / "manifest.json").unlink()  # (a node's cleaner took it): replaced, no ENOTEMPTY
    with caplog.at_level(logging.WARNING):
        assert staging.staged(tmp_path / "data", str(local), found, lambda: None) == (dest, True)
    assert (
        f"{dest} has no readable manifest.json (a copy that did not complete): staging it again"
    ) in caplog.text
    assert json.loads((dest / "manifest.json").read_text())["digest"] == found["digest"]


KILLED_COPY = """
import pathlib, sys, time
from ddppipe.data import manifest, staging
def slow():
    print("copying", flush=True)
    time.sleep(120)
data = pathlib.Path(sys.argv[1])
staging.staged(data, sys.argv[2], manifest.read(data), slow)
"""


def test_a_wait_for_the_nodes_copy_lasts_while_it_progresses_and_is_bounded_when_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process of the node copying: the wait beats this one's heartbeat as long as
    the copy progresses, then reuses it; a holder silent past the bound ends the wait with
    an error naming it."""
    monkeypatch.setattr(nodelock, "STALL_S", 1.0)
    monkeypatch.setattr(nodelock, "BEAT_EVERY_S", 0.1)
    found = data_of(tmp_path / "data", **{"a.bin": b"a" * (16 << 20)})  # four chunks
    local, started = str(tmp_path / "local"), threading.Event()

    def slow() -> None:  # the holder: a chunk every 0.4 s, 1.6 s in all
        started.set()
        time.sleep(0.4)

    holder = threading.Thread(target=staging.staged, args=(tmp_path / "data", local, found, slow))
    holder.start()
    assert started.wait(30)
    beats: list[float] = []
    dest, copied = staging.staged(tmp_path / "data", local, found,
                                  lambda: beats.append(time.monotonic()))  # fmt: skip
    holder.join()
    assert not copied and (dest / "a.bin").stat().st_size == 16 << 20
    assert beats[-1] - beats[0] > 1.0  # waited past the bound, beating, while it progressed

    lock = dest.parent / f".{dest.name}.lock"
    silent = os.open(lock, os.O_RDWR)
    fcntl.flock(silent, fcntl.LOCK_EX)
    os.pwrite(silent, b"pid 4242 on node7 since 2026-11-28 19:00:00\n", 0)
    try:
        waited = time.monotonic()
        with pytest.raises(nodelock.LockError, match=re.escape(
            f"{lock} is held by pid 4242 on node7 since 2026-11-28 19:00:00, which has shown "
            "no progress for 1 s (the limit: 1 s): if that process hangs, end it"
        )):  # fmt: skip
            staging.staged(tmp_path / "data", local, found, lambda: None)
        assert time.monotonic() - waited < 5
    finally:
        os.close(silent)
