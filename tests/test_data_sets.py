"""Which prepared data a run trains on (ddppipe.settings.data_sets) and what a task says its
prepare() reads (ddppipe.tasks.prepare_args). Quick: no workflow, no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddppipe.settings.data_sets import DataSets
from ddppipe.tasks import prepare_args

DIGITS = DataSets("digits", {"width": 8}, ("test_fraction", "split_seed"))


def test_runs_differing_only_in_what_prepare_does_not_read_share_the_base_data() -> None:
    assert DIGITS.name({"width": 8}) == "digits"
    assert DIGITS.name({"width": 16}) == "digits"


def test_runs_differing_in_what_prepare_reads_get_their_own_data() -> None:
    assert DIGITS.name({"width": 8, "test_fraction": 0.2}) == "digits+test_fraction=0.2"
    both = {"width": 16, "test_fraction": 0.2, "split_seed": 3}
    assert DIGITS.name(both) == "digits+split_seed=3+test_fraction=0.2"
    # prepared with the base's other arguments: the same for every run sharing the folder
    assert DIGITS.task_args(both) == {"width": 8, "test_fraction": 0.2, "split_seed": 3}


def test_without_prepare_args_every_argument_counts() -> None:
    data = DataSets("blobs", {"samples": 256})
    assert data.name({"samples": 256}) == "blobs"
    assert data.name({"samples": 64, "hidden": 4}) == "blobs+hidden=4+samples=64"


def test_a_value_whose_text_is_not_itself_gets_a_hash() -> None:
    data = DataSets("imagefolder", {"root": "/data/a"}, ("root",))
    one, other = data.name({"root": "/data/b"}), data.name({"root": "/data/c"})
    assert one.startswith("imagefolder+root=_data_b-") and one != other


def task_file(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "task.py"
    path.write_text(
        f'"""A task."""\n\nimport torch\n\n{line}\n\n\ndef prepare(d, args):\n    pass\n'
    )
    return path


def test_prepare_args_are_read_from_the_source(tmp_path: Path) -> None:
    assert prepare_args.read(task_file(tmp_path, 'PREPARE_ARGS = ("a", "b")')) == ("a", "b")
    assert prepare_args.read(task_file(tmp_path, "PREPARE_ARGS: tuple = ()")) == ()
    assert prepare_args.read(task_file(tmp_path, "OTHER = 1")) is None
    with pytest.raises(prepare_args.PrepareArgsError, match="must be a literal tuple"):
        prepare_args.read(task_file(tmp_path, 'PREPARE_ARGS = tuple("ab")'))


def test_the_built_in_tasks_declare_what_prepare_reads() -> None:
    src = Path(__file__).resolve().parents[1] / "src" / "ddppipe" / "tasks"
    assert prepare_args.read(src / "digits.py") == ("test_fraction", "split_seed")
    assert prepare_args.read(src / "mnist.py") == ("sha256",)
    assert prepare_args.read(src / "imagefolder.py") == (
        "root", "test_fraction", "split_seed", "pack", "image_size", "channels",
    )  # fmt: skip


def test_a_prepare_arg_the_schema_lacks_is_refused(tmp_path: Path) -> None:
    from ddppipe import tasks

    path = tmp_path / "typo.py"
    path.write_text(
        'PREPARE_ARGS = ("test_fraktion",)\n'
        'ARGS_SCHEMA = {"type": "object", "additionalProperties": False,\n'
        '               "properties": {"test_fraction": {"type": "number"}}}\n'
        "def prepare(d, args): pass\ndef datasets(d, args): pass\ndef model(args): pass\n"
    )
    task = tasks.load(str(path), cwd=tmp_path)
    with pytest.raises(
        tasks.TaskError, match="PREPARE_ARGS names test_fraktion, which ARGS_SCHEMA"
    ):
        tasks.validate_args(task, {})
