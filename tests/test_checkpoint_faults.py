"""The checkpoint store under faults: a full disk (a real tmpfs) and kill -9 mid-save."""

import errno
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddppipe.training.checkpoints import checkpoint, sharded_checkpoint, store_files
from tests.conftest import run_cli
from tests.small_disk import tmpfs
from tests.test_checkpoint import snapshot
from tests.test_train_ddp import cli_args
from tests.tiny import REPO, TinyData, tiny_config


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for this test."""
    with tmpfs(tmp_path / "small-disk", "2m") as mount:
        yield mount


def test_a_save_that_does_not_fit_raises_enospc_and_keeps_the_previous(small_disk: Path) -> None:
    store = checkpoint.Store(small_disk / "checkpoints")
    first = store.save(snapshot(1))
    too_big = snapshot(2)
    too_big["model"]["w"] = torch.ones(2**20)  # 4 MiB
    with pytest.raises(OSError) as raised:
        store.save(too_big)
    assert raised.value.errno == errno.ENOSPC
    assert "ckpt-e0002-s000000.pt" in str(raised.value)
    assert list(store.folder.iterdir()) == [first]  # no partial file, no temp file
    assert store.latest("abc")["epoch"] == 1


def test_a_small_file_on_a_full_disk_is_named_with_the_space_left(small_disk: Path) -> None:
    """A sharded checkpoint's state file (a few hundred bytes, the first write of a save) on a
    disk that other files filled: the OSError names it, the message the space left (torch's
    own writer said only "unexpected pos 704 vs 598")."""
    (small_disk / "filler").write_bytes(b"\0" * (2 * 2**20 - 4096))
    path = small_disk / "ckpt-e0001-s000000.saving" / sharded_checkpoint.STATE
    path.parent.mkdir()
    with pytest.raises(OSError) as raised:
        checkpoint.save({"epoch": 1, "notes": "x" * 8192}, path)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    message = store_files.write_failure(raised.value)
    assert message.startswith(f"rank 0 could not write {path}: [Errno 28] No space left")
    assert "MiB free (of 2.0 MiB): make room there" in message
    assert list(path.parent.iterdir()) == []  # no partial file, no temp file


def test_disk_full_fails_every_rank_promptly_with_rank_0s_message(
    tiny: TinyData, tmp_path: Path, small_disk: Path
) -> None:
    """Two ranks, the state folder on a 2 MiB tmpfs: the first checkpoint (~5 MB) cannot fit."""
    args = cli_args(tiny_config(tiny), tiny, tmp_path / "run")
    args = [f"--state={small_disk}" if a.startswith("--state=") else a for a in args]
    start = time.monotonic()
    result = run_cli("launch", *args, check=False, timeout=300)
    seconds = time.monotonic() - start
    assert result.returncode != 0, result.stderr
    assert seconds < 60, result.stderr  # not the process group's 600 s timeout
    message = "ddppipe train: error: rank 0 could not write"
    assert result.stderr.count(message) == 2, result.stderr  # printed by rank 0 and rank 1
    assert "No space left on device" in result.stderr
    assert "MiB free (of 2.0 MiB): make room there" in result.stderr
    assert not list(small_disk.rglob("*.tmp")) and not list(small_disk.rglob("*.saving"))
    assert sharded_checkpoint.Store(small_disk / "checkpoints").paths() == []


# Saves a 256 MiB checkpoint; should the write win the race against the kill, os.fsync (before
# the rename) waits, so the kill always lands before the checkpoint is in place.
SAVE_BIG = """
import os, sys, time
from pathlib import Path
import torch
from ddppipe.training.checkpoints import checkpoint, sharded_checkpoint
os.fsync = lambda fd: time.sleep(3600)
snap = {"epoch": 2, "step": 0, "model": {"w": torch.ones(64 * 2**20)}}
checkpoint.Store(Path(sys.argv[1])).save(snap)
"""


def test_kill_9_in_the_middle_of_a_save_leaves_a_temp_file_the_next_use_removes(
    tmp_path: Path,
) -> None:
    checkpoint.Store(tmp_path).save(snapshot(1))
    child = subprocess.Popen([sys.executable, "-c", SAVE_BIG, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (temps := [p for p in tmp_path.glob(".*.tmp") if p.stat().st_size > 0]):
            assert child.poll() is None, f"the saving process exited {child.returncode}"
            assert time.monotonic() < deadline, "no temp file appeared"
            time.sleep(0.001)
    finally:
        child.kill()
        child.wait()
    assert [p.name for p in temps] == [p.name for p in tmp_path.glob(".*.tmp")]
    assert not (tmp_path / "ckpt-e0002-s000000.pt").exists()
    store = checkpoint.Store(tmp_path)
    assert store.latest("abc")["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))
