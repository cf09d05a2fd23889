"""A folder the task reads packed once into one SquashFS image (``data.pack: squashfs``,
``ddppipe.data.squashfs``): written deterministically and atomically, mounted with squashfuse
or, without FUSE, unpacked once a node; two ranks train on it with the loose images gone."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ddppipe.data import manifest, squashfs, staging
from ddppipe.launching import resolve
from tests.conftest import prepare_in_process, run_cli
from tests.test_data_reading import AS_NOBODY, held_by_nobody, needs_root, plant, shared_folder
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
    (root / "red" / "convert.sh").write_text("#!/bin/sh\n")
    (root / "red" / "convert.sh").chmod(0o755)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = squashfs.write(root, tmp_path / "a", "root")
    assert IMAGE_NAME.fullmatch(first), first
    for image in root.glob("*/*.png"):  # other times and modes (umask 077's), the same content
        os.utime(image, (1_000_000, 1_000_000))
        image.chmod(0o600)
        image.parent.chmod(0o700)
    (root / "red" / "convert.sh").chmod(0o700)
    assert squashfs.write(root, tmp_path / "b", "root") == first
    assert os.listdir(tmp_path / "b") == [first]
    listed = subprocess.run(["unsquashfs", "-lls", str(tmp_path / "b" / first)],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    modes = {" ".join(line.split()[:2]) for line in listed.splitlines() if "squashfs-root" in line}
    assert modes == {"drwxr-xr-x root/root", "-rw-r--r-- root/root", "-rwxr-xr-x root/root"}
    assert "-rwxr-xr-x root/root" in next(x for x in listed.splitlines() if "convert.sh" in x)
    (root / "red" / "000.png").write_bytes(b"other")
    second = squashfs.write(root, tmp_path / "b", "root")
    assert second != first and os.listdir(tmp_path / "b") == [second]  # the old one removed

    (root / "red" / "link.png").symlink_to("000.png")  # kept a link in the image: refused
    with pytest.raises(squashfs.SquashfsError, match=r"symbolic links \(red/link\.png -> 000"):
        squashfs.write(root, tmp_path / "b", "root")
    assert os.listdir(tmp_path / "b") == [second]
    (root / "red" / "link.png").unlink()

    monkeypatch.setattr(squashfs, "MKSQUASHFS_ARGS", ("-no-such-option",))
    with pytest.raises(squashfs.SquashfsError, match=r"mksquashfs .* failed"):
        squashfs.write(root, tmp_path / "b", "root")
    assert os.listdir(tmp_path / "b") == [second]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(squashfs.SquashfsError, match="install squashfs-tools"):
        squashfs.write(root, tmp_path / "b", "root")


def test_squashfs_tools_older_than_4_4_are_named_with_the_fix() -> None:
    """RHEL 8's mksquashfs 4.3 has no -mkfs-time/-all-time: named before it runs; this
    machine's is accepted."""
    old = squashfs.version_problem("mksquashfs version 4.3-git (2014/06/09)\ncopyright (C) 2014")
    assert old is not None
    assert old.startswith("data.pack: squashfs needs squashfs-tools 4.4 or newer")
    assert "this mksquashfs is 4.3: install a newer squashfs-tools" in old
    assert squashfs.version_problem("mksquashfs version 4.4 (2019/08/29)") is None
    here = subprocess.run(["mksquashfs", "-version"], capture_output=True, text=True, check=False)
    assert re.match(r"mksquashfs version \d+\.\d+", here.stdout)
    assert squashfs.version_problem(here.stdout) is None


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


@pytest.mark.slow  # a world of 2 ranks, then an evaluation
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
    prepare_in_process(settings, data)
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


@pytest.mark.apptainer  # apptainer exec of a sandbox: slow (tests/conftest.py)
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
    prepare_in_process(settings, data)
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


@needs_root
def test_an_unpack_folder_a_mount_point_and_a_lock_another_user_planted_are_avoided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """nobody plants this user's folder name in the shared temporary folder, with the image's
    unpacked folder (other content), this process's mount point and the lock, held: the
    image is mounted and unpacked in a folder of this user's instead, named, with no wait;
    the unpacked copy is no other user's to read."""
    root = tmp_path / "images"
    write_images(root, per_class=2)
    image = squashfs.Image(tmp_path / squashfs.write(root, tmp_path, "root"), "root")
    name, red = f"sqfs-{image.digest}", (root / "red" / "000.png").read_bytes()
    with shared_folder() as shared:
        theirs, mine = shared / MINE, shared / f"{MINE}.1"
        plant(f"{theirs}/{name}/red/000.png=planted", f"{theirs}/{name}.{os.getpid()}/=",
              f"{theirs}/.{name}.lock=")  # fmt: skip
        monkeypatch.setattr(tempfile, "tempdir", str(shared))  # where the mounts go
        started = time.monotonic()
        with held_by_nobody(theirs / f".{name}.lock"), caplog.at_level(logging.WARNING):
            if fuse_mounts():
                with image.mounted(tmp_path / "local", lambda: None) as point:
                    assert point == mine / f"{name}.{os.getpid()}" and os.path.ismount(point)
                    assert (point / "red" / "000.png").read_bytes() == red
            monkeypatch.setattr(squashfs, "SQUASHFUSE", "no-such-squashfuse")
            with image.mounted(shared, lambda: None) as folder:
                assert folder == mine / name and (folder / "red" / "000.png").read_bytes() == red
        assert time.monotonic() - started < 10  # (no wait for nobody's lock)
        assert (
            f"{theirs} (drwxrwxrwx) is owned by nobody (uid 65534), not by this user "
            f"(root (uid 0)): not used (nothing in it read); using {mine} instead"
        ) in caplog.text
        assert (theirs / name / "red" / "000.png").read_text() == "planted"  # left as it was
        read = subprocess.run([*AS_NOBODY, "cat", str(folder / "red" / "000.png")],
                              capture_output=True, text=True, cwd="/")  # fmt: skip
        assert read.returncode != 0 and "Permission denied" in read.stderr


# An unsquashfs that reads the image for 1 s, then hangs 1 s (no input, no output), then works.
SLOW_UNSQUASHFS = """#!/usr/bin/python3
import os, sys, time
image = os.open(sys.argv[-1], os.O_RDONLY)
for _ in range(10):
    os.pread(image, 1, 0)
    time.sleep(0.1)
time.sleep(1.0)
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def test_a_long_unpacking_beats_the_ranks_heartbeat_while_it_progresses_only(
    tmp_path: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without FUSE, a rank's unpacking of its packed folder's image (``staging.for_rank``)
    beats the rank's heartbeat while unsquashfs reads or writes, and not while it hangs: the
    watchdog lets a long unpacking run and still sees a hung one."""
    root = tmp_path / "images"
    write_images(root, per_class=2)
    data = tmp_path / "data"
    data.mkdir()
    packed = squashfs.write(root, data, "root")
    manifest.write(data, {"ref": "t"}, {}, {squashfs.KEY: {"image": packed, "arg": "root"}})
    slow = tmp_path / "slow-unsquashfs"
    slow.write_text(SLOW_UNSQUASHFS.format(real=shutil.which("unsquashfs")))
    slow.chmod(0o755)
    monkeypatch.setattr(squashfs, "SQUASHFUSE", "no-such-squashfuse")
    monkeypatch.setattr(squashfs, "UNSQUASHFS", str(slow))
    beats: list[float] = []
    with contextlib.ExitStack() as held:
        started = time.monotonic()
        _, _, args = staging.for_rank(data, None, {"root": str(root)}, held,
                                      lambda: beats.append(time.monotonic()))  # fmt: skip
        ended = time.monotonic()
        assert args["root"] == str(tmp / MINE / f"sqfs-{packed.split('-')[1][:16]}")
        assert (Path(args["root"]) / "red" / "000.png").read_bytes() == (
            root / "red" / "000.png"
        ).read_bytes()
    assert ended - started > 2.0 and len(beats) >= 4, beats  # beats while reading
    gaps = [b - a for a, b in zip([started, *beats], [*beats, ended], strict=True)]
    assert max(gaps) > 0.8, gaps  # none while it hung
