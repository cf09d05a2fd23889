from pathlib import Path

import pytest
import torch

from ddppipe import checkpoint


def snapshot(epoch: int, step: int = 0, config_hash: str = "abc") -> dict:
    return {
        "format": checkpoint.FORMAT,
        "config_hash": config_hash,
        "epoch": epoch,
        "step": step,
        "model": {"w": torch.full((3,), float(epoch))},
        "optimizer": {},
        "scheduler": {},
        "rng": [torch.get_rng_state()],
        "history": [],
        "meta": {},
    }


def test_keeps_the_newest_and_orders_by_epoch_and_step(tmp_path: Path) -> None:
    store = checkpoint.Store(tmp_path, keep=2)
    for epoch, step in [(1, 0), (1, 50), (2, 0)]:
        store.save(snapshot(epoch, step))
    assert [p.name for p in store.paths()] == ["ckpt-e0001-s000050.pt", "ckpt-e0002-s000000.pt"]
    assert store.latest("abc")["epoch"] == 2


def test_truncated_newest_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = checkpoint.Store(tmp_path)
    store.save(snapshot(1))
    newest = store.save(snapshot(2))
    newest.write_bytes(newest.read_bytes()[:1000])
    assert store.latest("abc")["epoch"] == 1
    assert f"{newest}: unreadable checkpoint" in caplog.text
    assert "falling back to the previous checkpoint" in caplog.text


def test_other_config_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    store = checkpoint.Store(tmp_path)
    store.save(snapshot(1, config_hash="old"))
    assert store.latest("new") is None
    assert store.paths() == []
    assert (tmp_path / "stale-old" / "ckpt-e0001-s000000.pt").is_file()


def test_save_is_atomic_on_failure(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        checkpoint.save({"x": Boom()}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_weights_only_rejects_arbitrary_objects(tmp_path: Path) -> None:
    torch.save({"evil": Path("x")}, tmp_path / "c.pt")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable checkpoint"):
        checkpoint.load(tmp_path / "c.pt")
