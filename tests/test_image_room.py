"""Room on disk for an image build (ddppipe.apptainer.room): checked against real small file
systems (tmpfs) before ``apptainer build`` starts, the refusal said with both ways out; what
killed builds left removed first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddppipe.apptainer import building, room, tool
from tests import small_disk
from tests.container_fixtures import require_apptainer


def test_a_build_without_room_to_unpack_is_refused_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_apptainer()
    context = tmp_path / "context"  # no constraints.txt: no wheelhouse, the base need alone
    context.mkdir()
    recipe = context / "image.def"
    recipe.write_text("Bootstrap: debootstrap\nOSVersion: bookworm\n")
    image, log = tmp_path / "images" / "x.sif", tmp_path / "build.log"
    with small_disk.tmpfs(tmp_path / "small", "64m") as small:
        monkeypatch.setenv("APPTAINER_TMPDIR", str(small))
        with pytest.raises(tool.ContainerError) as refused:
            building.build(recipe, image, log, context)
    said = str(refused.value)
    assert said.startswith(
        f"not enough disk for the image build: it needs about 1.0 GB in {small} "
        "(the unpacked image): 0.1 GB free there. Free space there, or point APPTAINER_TMPDIR"
    )
    assert os.listdir(image.parent) == []  # nothing begun
    assert "# refused: not enough disk" in log.read_text()


def test_the_need_grows_with_the_wheels_and_folders_on_one_disk_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with small_disk.tmpfs(tmp_path / "disk", "3g") as disk:  # 3 GiB: 3.2 GB free
        wheels, image = disk / "wheels", disk / "images" / "x.sif"
        wheels.mkdir()
        monkeypatch.setenv("APPTAINER_TMPDIR", str(disk / "unpack"))
        monkeypatch.setenv("TMPDIR", "/nowhere")  # APPTAINER_TMPDIR wins
        room.check(wheels, image)  # no wheels: 1.0 + 0.5 GB
        with open(wheels / "torch.whl", "wb") as f:  # 1 GB (sparse: it takes no room)
            f.truncate(1_000_000_000)
        with pytest.raises(tool.ContainerError, match=(
            rf"about 3\.0 GB in {disk}/unpack \(the unpacked image\) and 1\.7 GB in "
            rf"{disk}/images \(the image\): 3\.2 GB free there\."
        )):  # fmt: skip
            room.check(wheels, image)
        monkeypatch.delenv("APPTAINER_TMPDIR")
        monkeypatch.setenv("TMPDIR", str(tmp_path))  # unpacked elsewhere: the image alone fits
        room.check(wheels, image)


def test_what_a_killed_build_left_is_removed_and_a_running_ones_kept(tmp_path: Path) -> None:
    """A build writes ``.<image>.<host>.<pid>.building`` first: the next build removes the one
    of an ended process of this host, not a running one's nor another host's."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    image = tmp_path / "x.sif"
    left = {name: tmp_path / name for name in (
        f".x.sif.{host}.{ended}.building", f".x.sif.{host}.{os.getpid()}.building",
        f".x.sif.other-node.{ended}.building", f".y.sif.{host}.{ended}.building",
    )}  # fmt: skip
    for path in left.values():
        path.write_bytes(b"part of an image")
    building.remove_killed_builds(image)
    assert sorted(os.listdir(tmp_path)) == sorted(list(left)[1:])
