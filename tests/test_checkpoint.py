import zipfile
from pathlib import Path

import pytest
import torch

from ddppipe.training.checkpoints import checkpoint


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


def test_damaged_newest_twice_in_a_row_is_moved_aside_and_keep_good_ones_remain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each resume finds a freshly damaged ckpt-e0002 and resumes from the good one before it."""
    store = checkpoint.Store(tmp_path, keep=2)
    store.save(snapshot(1))
    store.save(snapshot(2))
    for attempt in (1, 2):
        newest = store.paths()[-1]
        assert newest.name == "ckpt-e0002-s000000.pt"
        newest.write_bytes(b"damaged %d" % attempt)
        resumed, step = store.latest("abc"), 10 * (attempt - 1)
        assert (resumed["epoch"], resumed["step"]) == (1, step)
        assert f"{newest}: unreadable checkpoint" in caplog.text
        # The resumed run stops 10 steps later (a checkpoint of another name), then ends epoch 2.
        store.save(snapshot(1, step + 10))
        assert [checkpoint.load(p)["step"] for p in store.paths()] == [step, step + 10]
        store.save(snapshot(2))
    damaged = tmp_path / "damaged"
    first, second = damaged / "ckpt-e0002-s000000.pt", damaged / "ckpt-e0002-s000000.1.pt"
    assert sorted(damaged.iterdir()) == sorted([first, second])
    assert (first.read_bytes(), second.read_bytes()) == (b"damaged 1", b"damaged 2")
    assert f"moved to {second}, falling back" in caplog.text


def test_moving_aside_into_an_existing_stale_folder_overwrites_nothing(tmp_path: Path) -> None:
    """Config old, new, old, new: both runs of the old config stay in stale-old/."""
    store = checkpoint.Store(tmp_path)
    for attempt in (1, 2):
        old = snapshot(1, config_hash="old")
        old["history"] = [{"attempt": attempt}]
        store.save(old)
        assert store.latest("new") is None
    stale = tmp_path / "stale-old"
    assert sorted(p.name for p in stale.iterdir()) == [
        "ckpt-e0001-s000000.1.pt",
        "ckpt-e0001-s000000.pt",
    ]
    assert checkpoint.load(stale / "ckpt-e0001-s000000.pt")["history"] == [{"attempt": 1}]
    assert checkpoint.load(stale / "ckpt-e0001-s000000.1.pt")["history"] == [{"attempt": 2}]
    assert store.paths() == []


def test_leftover_temp_files_of_checkpoints_are_removed_others_kept(tmp_path: Path) -> None:
    """A save killed before its rename leaves `.<name>.<random>.tmp`; the next save removes it."""
    leftover = tmp_path / ".ckpt-e0001-s000000.pt.k3_x9qzb.tmp"
    leftover.write_bytes(b"half a checkpoint")
    others = [tmp_path / ".metrics.jsonl.abcdefgh.tmp", tmp_path / "notes.tmp"]
    for other in others:
        other.write_text("not ours")
    checkpoint.Store(tmp_path).save(snapshot(2))
    assert not leftover.exists()
    assert all(other.exists() for other in others)


def test_a_state_dict_on_the_cpu_keeps_its_shape() -> None:
    """The final checkpoint's state dicts are moved to the CPU (a GPU run's final.pt loads on
    any machine without map_location): the same keys, nesting and values, detached."""
    from ddppipe.training.checkpoints import checkpoint as ckpt

    weight = torch.nn.Parameter(torch.ones(2, 2))
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": weight * 2}},
             "param_groups": [{"lr": 0.1, "params": [0]}], "pair": (weight, 1)}  # fmt: skip
    moved = ckpt.on_cpu(state)
    assert moved["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(moved["state"][0]["exp_avg"], torch.full((2, 2), 2.0))
    assert not moved["state"][0]["exp_avg"].requires_grad and moved["pair"][1] == 1
    assert isinstance(moved["pair"], tuple) and moved["pair"][0].device.type == "cpu"


def test_the_same_weights_give_the_same_bytes_whatever_the_file_is_called(tmp_path: Path) -> None:
    """Two runs' model.pt compare by SHA-256: the archive's folder is torch's "archive", not
    the atomic write's temporary name (it was `.model.pt.0jv26qhe/data.pkl` in one run and
    `.model.pt.koevcgm2/data.pkl` in another)."""
    torch.manual_seed(0)
    weights = {"model": torch.nn.Linear(3, 2).state_dict()}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    checkpoint.save_weights(weights, tmp_path / "a" / "model.pt")
    checkpoint.save_weights(weights, tmp_path / "b" / "weights.pt")
    one, other = (
        (tmp_path / "a" / "model.pt").read_bytes(),
        (tmp_path / "b" / "weights.pt").read_bytes(),
    )
    assert one == other
    names = zipfile.ZipFile(tmp_path / "a" / "model.pt").namelist()
    assert "archive/data.pkl" in names, names
