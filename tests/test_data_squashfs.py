"""A folder the task reads packed once into one SquashFS image (``data.pack: squashfs``,
``ddppipe.data.squashfs``): written deterministically and atomically, mounted with squashfuse
or, without FUSE, unpacked once a node; two ranks train on it with the loose images gone."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddppipe.data import squashfs
from ddppipe.launching import resolve
from tests.conftest import run_cli
from tests.test_tasks_builtin import write_images
from tests.tiny import default_config

IMAGE_NAME = re.compile(r"root-[0-9a-f]{16}\.sqfs")
MINE = f"ddppipe-{os.getuid()}"  # this user's private folder in a node-local one


def fuse_mounts() -> bool:
    return shutil.which("squashfuse") is not None and os.path.exists("/dev/fuse")


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own temporary folder, where the mounts go."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_the_same_content_gives_the_same_image_and_a_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "images"
    write_images(root, per_class=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = squashfs.write(root, tmp_path / "a", "root")
    assert IMAGE_NAME.fullmatch(first), first
    for image in root.glob("*/*.png"):  # other times, the same content
        os.utime(image, (1_000_000, 1_000_000))
    assert squashfs.write(root, tmp_path / "b", "root") == first
    assert os.listdir(tmp_path / "b") == [first]
    (root / "red" / "000.png").write_bytes(b"other")
    second = squashfs.write(root, tmp_path / "b", "root")
    assert second != first and os.listdir(tmp_path / "b") == [second]  # the old one removed

    monkeypatch.setattr(squashfs, "MKSQUASHFS_ARGS", ("-no-such-option",))
    with pytest.raises(squashfs.SquashfsError, match=r"mksquashfs .* failed"):
        squashfs.write(root, tmp_path / "b", "root")
    assert os.listdir(tmp_path / "b") == [second]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(squashfs.SquashfsError, match="install squashfs-tools"):
        squashfs.write(root, tmp_path / "b", "root")


def test_a_mount_ends_with_its_process_and_one_left_by_a_killed_one_is_removed(
    tmp_path: Path, tmp: Path
) -> None:
    root = tmp_path / "images"
    write_images(root, per_class=2)
    image = squashfs.Image(tmp_path / squashfs.write(root, tmp_path, "root"), "root")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp / MINE).mkdir(mode=0o700)
    stale = tmp / MINE / f"sqfs-{image.digest}.{dead.pid}"
    stale.mkdir()
    subprocess.run(["squashfuse", str(image.path), str(stale)], check=True)
    with image.mounted(tmp_path / "local", lambda: None) as folder:
        assert folder == tmp / MINE / f"sqfs-{image.digest}.{os.getpid()}"
        assert os.path.ismount(folder)
        assert sorted(p.name for p in folder.iterdir()) == ["blue", "green", "red"]
        assert (folder / "red" / "001.png").read_bytes() == (root / "red/001.png").read_bytes()
        assert not stale.exists()  # the killed process's mount: unmounted and removed
    assert os.listdir(tmp) == [MINE] and os.listdir(tmp / MINE) == []
    assert not (tmp_path / "local").exists()  # nothing unpacked


def test_without_fuse_the_image_is_unpacked_once_a_node(
    tmp_path: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "images"
    write_images(root, per_class=2)
    image = squashfs.Image(tmp_path / squashfs.write(root, tmp_path, "root"), "root")
    monkeypatch.setattr(squashfs, "SQUASHFUSE", "no-such-squashfuse")
    local = tmp_path / "local"
    with image.mounted(local, lambda: None) as folder:
        assert folder == local / MINE / f"sqfs-{image.digest}"
        assert (folder / "green" / "000.png").read_bytes() == (root / "green/000.png").read_bytes()
    assert "no no-such-squashfuse here: the image is unpacked" in caplog.text
    monkeypatch.setattr(squashfs, "UNSQUASHFS", "no-such-unsquashfs")  # not needed again
    with image.mounted(local, lambda: None) as again:
        assert again == folder
    assert sorted(os.listdir(local / MINE)) == [f".sqfs-{image.digest}.lock", folder.name]
    assert stat.S_IMODE((local / MINE).stat().st_mode) == 0o700  # the copy: this user's only
    other = squashfs.Image(image.path, "root")
    refused = pytest.raises(squashfs.SquashfsError, match="needs no-such-unsquashfs")
    with refused, other.mounted(tmp_path / "another-node", lambda: None):
        pass
    assert os.listdir(tmp_path / "another-node" / MINE) == [f".sqfs-{image.digest}.lock"]


def test_two_ranks_train_on_a_squashfs_image_staged_once_with_the_images_gone(
    tmp_path: Path,
) -> None:
    """`ddppipe prepare` packs the image folder into one image recorded in the manifest; the
    images are then removed: two ranks stage the data folder (the image and the index), mount
    the image (squashfuse, else unpacked) and train and evaluate on it."""
    root = tmp_path / "images"
    write_images(root, per_class=16)
    cfg = default_config()
    cfg.update(
        run="squashed",
        task="ddppipe.tasks.imagefolder",
        task_args={"root": str(root), "image_size": 16, "width": 8},
        data={"pack": "squashfs"},
    )
    cfg["train"].update(epochs=1, batch_size=8, eval_batch_size=16, precision="fp32")
    cfg["launch"]["stage_data"] = str(tmp_path / "node-local")
    settings = tmp_path / "data.yaml"
    settings.write_text(json.dumps({k: cfg[k] for k in ("task", "task_args", "data")}))
    data = tmp_path / "data"
    run_cli("prepare", f"--settings={settings}", f"--dest={data}")
    found = json.loads((data / "manifest.json").read_text())
    image = found["squashfs"]["image"]
    assert IMAGE_NAME.fullmatch(image) and found["squashfs"]["arg"] == "root"
    assert sorted(found["files"]) == ["index.json", image]
    run = tmp_path / "run"
    resolve.write_resolved(cfg, run / "config.yaml", gpus=False)  # task_args and model checked
    shutil.rmtree(root)
    log = run_cli("launch", f"--config={run / 'config.yaml'}", f"--data={data}",
                  f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
                  f"--metrics={run / 'metrics.jsonl'}").stderr  # fmt: skip
    staged = tmp_path / "node-local" / MINE / f"data-{found['digest']}"
    assert sorted(p.name for p in staged.iterdir()) == ["index.json", "manifest.json", image]
    if fuse_mounts():
        points = Path(tempfile.gettempdir()) / MINE / f"sqfs-{image.split('-')[1][:16]}"
        assert log.count(f"mounted {staged / image} on {points}.") == 1, log  # rank 0's log
        assert not list(points.parent.glob(f"{points.name}.*"))  # each rank's mount gone
    epochs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["epoch"], m["world_size"]) for m in epochs] == [(1, 2)]
    assert epochs[-1]["test_accuracy"] > 0.5  # three colours, 36 training images
    # `ddppipe evaluate` of the final checkpoint, one process, the images still gone: through
    # the image as well (mounted, or unpacked, for the command), the training's figures
    run_cli("evaluate", f"--checkpoint={run / 'final.pt'}", f"--config={run / 'config.yaml'}",
            f"--data={data}", f"--metrics={tmp_path / 'again.json'}",
            f"--plot={tmp_path / 'again.png'}")  # fmt: skip
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["test_count"] == 9 and again["test_accuracy"] == epochs[-1]["test_accuracy"]


def test_in_a_container_the_image_is_bound_over_the_folder(tmp_path: Path) -> None:
    """container.mode apptainer: the launcher binds the image over task_args.root
    (``--bind IMAGE:ROOT:image-src=/``), where the ranks read it as the folder itself. The
    container: a sandbox of this machine's own /usr and Python environment (the DAG's real
    image is tests/test_container.py's, minutes to build)."""
    sandbox = tmp_path / "host.sif"  # (a folder: Apptainer runs it as a sandbox image)
    for folder in ("usr", "proc", "sys", "dev", "tmp", "etc", "root", "home"):
        (sandbox / folder).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        (sandbox / link).symlink_to(f"usr/{link}")
    root = tmp_path / "images"
    write_images(root, per_class=16)
    cfg = default_config()
    cfg.update(run="bound", task="ddppipe.tasks.imagefolder", data={"pack": "squashfs"},
               task_args={"root": str(root), "image_size": 16, "width": 8})  # fmt: skip
    cfg["train"].update(epochs=1, batch_size=8, eval_batch_size=16, precision="fp32")
    cfg["launch"]["nproc_per_node"] = 1
    venv = Path(sys.prefix).resolve()
    cfg["container"] = {"mode": "apptainer", "image": str(sandbox), "exec_args": [
        "--bind", "/usr", "--bind", str(venv), "--env", f"PREPEND_PATH={venv}/bin",
    ]}  # fmt: skip
    settings = tmp_path / "data.yaml"
    settings.write_text(json.dumps({k: cfg[k] for k in ("task", "task_args", "data")}))
    data = tmp_path / "data"
    run_cli("prepare", f"--settings={settings}", f"--dest={data}")
    run = tmp_path / "run"
    resolve.write_resolved(cfg, run / "config.yaml", gpus=False)
    for image in root.glob("*/*.png"):  # the class folders stay, empty: the bind's target
        image.unlink()
    image = json.loads((data / "manifest.json").read_text())["squashfs"]["image"]
    log = run_cli("launch", f"--config={run / 'config.yaml'}", f"--data={data}",
                  f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
                  f"--metrics={run / 'metrics.jsonl'}").stderr  # fmt: skip
    assert f"--bind {data.resolve() / image}:{root}:image-src=/ {sandbox} python" in log, log
    assert "mounted" not in log and "unpacked" not in log, log  # the bind, no mount of its own
    (epoch,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert epoch["test_accuracy"] > 0.5
