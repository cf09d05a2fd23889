"""The built-in tasks (MNIST's model, digits, imagefolder) and the example task: fast, one
process."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader

from ddppipe import tasks
from ddppipe.data import Tensors
from ddppipe.tasks import digits, imagefolder
from tests.tiny import REPO

MNIST = tasks.load("ddppipe.tasks.mnist")
DIGITS = tasks.load("ddppipe.tasks.digits")
IMAGEFOLDER = tasks.load("ddppipe.tasks.imagefolder")
# Solid colours, one per class; every image gets its own jitter and a random bright square.
COLOURS = {"blue": (30, 40, 220), "green": (30, 200, 50), "red": (220, 30, 30)}


def args_of(task: tasks.Task, **args: Any) -> dict[str, Any]:
    """``task_args`` as ddppipe hands them to the task: validated, with defaults filled."""
    return tasks.validate_args(task, args)


def write_images(folder: Path, per_class: int = 12, seed: int = 0,
                 colours: dict[str, tuple[int, int, int]] = COLOURS) -> None:  # fmt: skip
    """``per_class`` 16x16 PNG images of each colour in ``folder/<colour>/``."""
    rng = np.random.default_rng(seed)
    for name, colour in colours.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(np.array(colour) + rng.integers(-30, 31, (16, 16, 3)), 0, 255)
            x, y = rng.integers(0, 12, 2)
            pixels[y : y + 4, x : x + 4] = 255
            Image.fromarray(pixels.astype(np.uint8)).save(folder / name / f"{i:03d}.png")


# --- mnist ----------------------------------------------------------------------------


def test_mnist_model_is_the_seeds_cnn_or_its_batchnorm_variant() -> None:
    seeds = MNIST.call("model", args_of(MNIST))
    assert sorted(seeds.state_dict()) == [
        f"{layer}.{p}" for layer in ("conv1", "conv2", "fc1", "fc2") for p in ("bias", "weight")
    ]
    assert (seeds.dropout1.p, seeds.dropout2.p) == (0.25, 0.5)
    variant = MNIST.call("model", args_of(MNIST, batchnorm=True))
    assert set(variant.state_dict()) - set(seeds.state_dict()) == {
        f"norm{i}.{p}" for i in (1, 2)
        for p in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    }  # fmt: skip
    assert (variant.norm1.num_features, variant.norm2.num_features) == (32, 64)
    assert (variant.dropout1.p, variant.dropout2.p) == (0.0, 0.0)
    x = torch.randn(4, 1, 28, 28)
    assert variant(x).shape == seeds(x).shape == (4, 10)


# --- digits ---------------------------------------------------------------------------


def test_digits_prepare_is_idempotent_and_split_deterministic(tmp_path: Path) -> None:
    args = args_of(DIGITS)
    assert args == {"test_fraction": 0.25, "split_seed": 0, "width": 32}
    digits.prepare(tmp_path / "a", args)
    path = tmp_path / "a" / digits.FILE
    first, stat = path.read_bytes(), path.stat()
    digits.prepare(tmp_path / "a", args)  # present and identical: not rewritten
    assert path.stat().st_ino == stat.st_ino and path.stat().st_mtime_ns == stat.st_mtime_ns
    digits.prepare(tmp_path / "b", args)
    assert (tmp_path / "b" / digits.FILE).read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["digits.pt"]

    train, test = digits.datasets(tmp_path / "a", args)
    assert (len(train), len(test)) == (1347, 450)
    # Stratified: each class gives round(n / 4) of its images to the test set.
    assert torch.bincount(test.targets).tolist() == [44, 46, 44, 46, 45, 46, 45, 45, 44, 45]
    assert torch.bincount(train.targets).tolist() == [134, 136, 133, 137, 136, 136, 136, 134,
                                                      130, 135]  # fmt: skip

    other = args_of(DIGITS, split_seed=1)
    digits.prepare(tmp_path / "c", other)
    _, test_c = digits.datasets(tmp_path / "c", other)
    assert torch.bincount(test_c.targets).tolist() == torch.bincount(test.targets).tolist()
    assert not torch.equal(test_c.inputs, test.inputs)
    with pytest.raises(ValueError, match="prepare"):
        digits.datasets(tmp_path / "a", other)  # prepared for another split


def test_digits_datasets_and_model(tmp_path: Path) -> None:
    args = args_of(DIGITS, width=8)
    digits.prepare(tmp_path, args)
    train, test = digits.datasets(tmp_path, args)
    assert isinstance(train, Tensors) and isinstance(test, Tensors)
    assert train.inputs.shape == (1347, 1, 8, 8) and train.inputs.dtype == torch.uint8
    assert int(train.inputs.max()) == 16
    assert train.targets.dtype == torch.int64 and set(train.targets.tolist()) == set(range(10))
    x, y = train.batch(torch.arange(64))
    assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32 and y.shape == (64,)
    assert abs(float(digits.normalize(train.inputs).mean())) < 0.05
    net = DIGITS.call("model", args)
    assert net.conv1.out_channels == 8
    assert net(x).shape == (64, 10)


# --- imagefolder ----------------------------------------------------------------------


def test_imagefolder_prepare_writes_an_index(tmp_path: Path) -> None:
    root, data = tmp_path / "images", tmp_path / "data"
    write_images(root)
    args = args_of(IMAGEFOLDER, root=str(root))
    imagefolder.prepare(data, args)
    index = json.loads((data / "index.json").read_text())
    assert index["classes"] == ["blue", "green", "red"]
    assert index["counts"] == {"train": 30, "test": 6}  # round(12 * 0.2) = 2 per class
    assert index["split"] == {"test_fraction": 0.2, "split_seed": 0}
    tests = [im for im in index["images"] if im["split"] == "test"]
    assert sorted(im["class"] for im in tests) == ["blue"] * 2 + ["green"] * 2 + ["red"] * 2
    first = index["images"][0]
    assert first["path"] == "blue/000.png" and first["class"] == "blue"
    assert first["sha256"] == hashlib.sha256((root / "blue/000.png").read_bytes()).hexdigest()

    text, stat = (data / "index.json").read_text(), (data / "index.json").stat()
    imagefolder.prepare(data, args)  # unchanged: not rewritten
    assert (data / "index.json").stat().st_mtime_ns == stat.st_mtime_ns
    imagefolder.prepare(tmp_path / "again", args)
    assert (tmp_path / "again" / "index.json").read_text() == text
    assert sorted(p.name for p in data.iterdir()) == [".cache", "index.json"]  # + stat cache


def test_imagefolder_index_is_the_text_json_writes(tmp_path: Path) -> None:
    """The index's text is json.dumps(indent=1)'s, as before it was written by hand: the
    data's identity (the manifest's digest) is that of earlier versions."""
    root = tmp_path / "images"
    write_images(root, per_class=2, colours={'say "hi"': (1, 2, 3), "\u00fcber": (4, 5, 6)})
    (root / "\u00fcber" / "sub").mkdir()
    (root / "\u00fcber" / "sub" / "x.PNG").write_bytes(
        (root / "\u00fcber" / "000.png").read_bytes()
    )
    imagefolder.prepare(tmp_path / "data", args_of(IMAGEFOLDER, root=str(root)))
    text = (tmp_path / "data" / "index.json").read_text()
    assert text == json.dumps(json.loads(text), indent=1) + "\n"
    index = json.loads(text)
    assert index["classes"] == ['say "hi"', "\u00fcber"]
    assert [im["path"] for im in index["images"]] == [
        'say "hi"/000.png', 'say "hi"/001.png', "\u00fcber/000.png", "\u00fcber/001.png",
        "\u00fcber/sub/x.PNG",
    ]  # fmt: skip
    assert '   "path": "\\u00fcber/sub/x.PNG",\n   "class": "\\u00fcber",\n' in text


def test_imagefolder_prepare_takes_the_extensions_imagefolder_reads() -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    assert imagefolder.EXTENSIONS == IMG_EXTENSIONS  # held by prepare, which skips torchvision


def test_imagefolder_train_test_layout(tmp_path: Path) -> None:
    write_images(tmp_path / "train", per_class=5)
    write_images(tmp_path / "test", per_class=2, seed=1)
    args = args_of(IMAGEFOLDER, root=str(tmp_path), channels=1, image_size=8)
    imagefolder.prepare(tmp_path / "data", args)
    index = json.loads((tmp_path / "data" / "index.json").read_text())
    assert index["counts"] == {"train": 15, "test": 6} and index["split"] is None
    assert index["images"][0]["path"] == "train/blue/000.png"
    train, test = imagefolder.datasets(tmp_path / "data", args)
    assert (len(train), len(test)) == (15, 6)
    x, y = next(iter(DataLoader(test, batch_size=6, num_workers=2)))
    assert x.shape == (6, 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [0, 0, 1, 1, 2, 2]
    assert IMAGEFOLDER.call("model", args)(x).shape == (6, 3)


def test_imagefolder_refuses_an_image_changed_in_place_since_prepare(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loose path compares each image's size and mtime with prepare's records (its stat
    cache) and hashes those that moved: an image edited in place is refused by name, one only
    touched trains; without the cache (a staged data folder) every image is hashed."""
    root, data = tmp_path / "images", tmp_path / "data"
    write_images(root, per_class=4)
    args = args_of(IMAGEFOLDER, root=str(root), image_size=8)
    imagefolder.prepare(data, args)
    red = root / "red" / "001.png"
    os.utime(red, ns=(10**9, 10**9))  # touched: the same content
    imagefolder.datasets(data, args)
    edited = bytearray(red.read_bytes())  # a byte changed in place: the same size
    edited[-20] ^= 0xFF
    red.write_bytes(bytes(edited))
    os.utime(red, ns=(2 * 10**9, 2 * 10**9))
    with pytest.raises(imagefolder.ImageFolderError) as refused:
        imagefolder.datasets(data, args)
    assert str(refused.value) == (
        f"{root} changed since {data / 'index.json'} was written: prepare the data again "
        "(snakemake --forcerun prepare_data) (changed in place: red/001.png: not the content "
        "whose SHA-256 the index records)"
    )
    shutil.rmtree(data / ".cache")  # nothing recorded: each image read
    with pytest.raises(imagefolder.ImageFolderError, match=r"in place: red/001\.png: not"):
        imagefolder.datasets(data, args)
    # (with data.pack: squashfs root is the content of an image the manifest covers: unread)
    (data / "manifest.json").write_text(json.dumps({"squashfs": {"image": "x", "arg": "root"}}))
    assert [len(part) for part in imagefolder.datasets(data, args)] == [9, 3]
    (data / "manifest.json").unlink()
    red.write_bytes((root / "blue" / "002.png").read_bytes())  # a picture that reads
    imagefolder.prepare(data, args)  # prepared again: it trains
    assert [len(part) for part in imagefolder.datasets(data, args)] == [9, 3]
    # the split layout too (its own groups of the stat cache: train/<class>)
    write_images(tmp_path / "split" / "train", per_class=3)
    write_images(tmp_path / "split" / "test", per_class=2, seed=1)
    args = args_of(IMAGEFOLDER, root=str(tmp_path / "split"), image_size=8)
    imagefolder.prepare(tmp_path / "split-data", args)
    (tmp_path / "split" / "test" / "green" / "001.png").write_bytes(red.read_bytes())
    with pytest.raises(imagefolder.ImageFolderError, match=r"place: test/green/001\.png: not"):
        imagefolder.datasets(tmp_path / "split-data", args)


def test_imagefolder_datasets_through_workers(tmp_path: Path) -> None:
    write_images(tmp_path / "images")
    args = args_of(IMAGEFOLDER, root=str(tmp_path / "images"), image_size=16)
    imagefolder.prepare(tmp_path / "data", args)
    train, test = imagefolder.datasets(tmp_path / "data", args)
    assert (len(train), len(test)) == (30, 6)
    batches = list(DataLoader(train, batch_size=10, num_workers=2))
    assert [tuple(x.shape) for x, _ in batches] == [(10, 3, 16, 16)] * 3
    assert all(y.dtype == torch.int64 for _, y in batches)
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == [0] * 10 + [1] * 10 + [2] * 10
    assert float(batches[0][0].min()) >= -1 and float(batches[0][0].max()) <= 1

    (tmp_path / "images" / "red" / "extra.png").write_bytes(
        (tmp_path / "images" / "red" / "000.png").read_bytes()
    )
    with pytest.raises(imagefolder.ImageFolderError, match=r"changed since .*red/extra\.png"):
        imagefolder.datasets(tmp_path / "data", args)


def test_imagefolder_model_needs_no_prepare(tmp_path: Path) -> None:
    write_images(tmp_path, per_class=1, colours={f"c{i}": (i, i, i) for i in range(5)})
    net = IMAGEFOLDER.call("model", args_of(IMAGEFOLDER, root=str(tmp_path), width=4))
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 5)


def test_imagefolder_layout_errors_name_the_folder(tmp_path: Path) -> None:
    def prepare(root: Path) -> None:
        imagefolder.prepare(tmp_path / "data", args_of(IMAGEFOLDER, root=str(root)))

    with pytest.raises(
        imagefolder.ImageFolderError, match=re.escape(f"no folder {tmp_path}/missing")
    ):
        prepare(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    with pytest.raises(
        imagefolder.ImageFolderError, match=re.escape(f"{tmp_path}/flat holds no class")
    ):
        prepare(tmp_path / "flat")
    write_images(tmp_path / "flat", per_class=3)
    (tmp_path / "flat" / "yellow").mkdir()
    empty = re.escape(f"class folder {tmp_path}/flat/yellow holds no images")
    with pytest.raises(imagefolder.ImageFolderError, match=empty):
        prepare(tmp_path / "flat")
    write_images(tmp_path / "split" / "train", per_class=2)
    with pytest.raises(imagefolder.ImageFolderError, match=r"has train/ but no test/"):
        prepare(tmp_path / "split")
    write_images(tmp_path / "split" / "test", per_class=2, colours={"blue": (0, 0, 255)})
    with pytest.raises(imagefolder.ImageFolderError) as error:
        prepare(tmp_path / "split")
    message = str(error.value)
    assert f"{tmp_path}/split/train and {tmp_path}/split/test" in message
    assert "only in train/: green, red; only in test/: -" in message
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "0.png").write_bytes(b"not a png")
    (tmp_path / "broken" / "a" / "1.png").write_bytes(b"not a png")
    with pytest.raises(imagefolder.ImageFolderError, match=r"0\.png is not a readable image"):
        prepare(tmp_path / "broken")
    assert not (tmp_path / "data").exists()


def test_imagefolder_learns_easy_images(tmp_path: Path) -> None:
    write_images(tmp_path / "images", per_class=20)
    args = args_of(IMAGEFOLDER, root=str(tmp_path / "images"), image_size=16, width=8,
                   test_fraction=0.25)  # fmt: skip
    imagefolder.prepare(tmp_path / "data", args)
    train, test = imagefolder.datasets(tmp_path / "data", args)
    torch.manual_seed(0)
    net = imagefolder.model(args)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.004)
    images = torch.stack([x for x, _ in train])  # decoded once: the test is about learning
    labels = torch.tensor([y for _, y in train])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: threads only wait on a busy machine
    try:
        for _ in range(5):
            for batch in torch.randperm(len(train)).split(8):
                loss = F.cross_entropy(net(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    net.eval()
    x, y = next(iter(DataLoader(test, batch_size=len(test))))
    with torch.no_grad():
        accuracy = (net(x).argmax(1) == y).float().mean().item()
    assert len(y) == 15 and accuracy >= 0.9


# --- loading ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "name", "path"),
    [
        ("ddppipe.tasks.digits", "digits", Path(digits.__file__)),
        ("ddppipe.tasks.imagefolder", "imagefolder", Path(imagefolder.__file__)),
        ("examples/tasks/tinycnn.py", "tinycnn", REPO / "examples" / "tasks" / "tinycnn.py"),
    ],
)
def test_tasks_load(ref: str, name: str, path: Path) -> None:
    task = tasks.load(ref, cwd=REPO)
    assert task.name == name and task.source.path == str(path.resolve())
    assert task.source.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert all(task.has(hook) for hook in tasks.REQUIRED)


def test_example_task_trains(tmp_path: Path) -> None:
    task = tasks.load("examples/tasks/tinycnn.py", cwd=REPO)
    args = args_of(task)
    task.call("prepare", tmp_path, args)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    task.call("prepare", tmp_path, args)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    train, test = task.call("datasets", tmp_path, args)
    assert (len(train), len(test)) == (3200, 800)
    x, y = next(iter(DataLoader(test, batch_size=len(test))))
    torch.manual_seed(0)
    net = task.call("model", args)
    metrics = task.call("metrics", net(x), y)
    assert set(metrics) >= {"loss", "accuracy"} and metrics["accuracy"] <= len(test)
    assert task.call("loss", net(x[:4]), y[:4]).shape == ()


def test_a_tasks_version_is_its_distributions() -> None:
    # ddppipe's package is named as its distribution; yaml's (PyYAML) is not
    assert tasks.locate("ddppipe.tasks.mnist").version == importlib.metadata.version("ddppipe")
    assert tasks.locate("yaml").version == importlib.metadata.version("PyYAML")
    assert tasks.locate("tests.tiny").version is None  # no installed distribution


def test_a_task_importing_a_moved_module_is_told_where_it_went(tmp_path: Path) -> None:
    old = tmp_path / "old.py"
    old.write_text("from ddppipe.model import Net\n")
    with pytest.raises(tasks.TaskError) as e:
        tasks.load(str(old))
    assert str(e.value) == (
        f"task {old} ({old}): importing it raised ModuleNotFoundError: No module named "
        "'ddppipe.model'; ddppipe.model is now ddppipe.tasks.model (from ddppipe.tasks.model "
        "import Net); rename the import"
    )
    from ddppipe import job  # the script API keeps its import
    from ddppipe.data import Tensors  # and tasks' in-memory datasets theirs
    from ddppipe.training import job as before_packages  # (its old path, README's before)

    assert before_packages is job

    assert (
        job.__name__ == "ddppipe.training.script.job"
        and Tensors.__module__ == "ddppipe.data.batches"
    )
