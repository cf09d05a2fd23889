import gzip
import shutil
from pathlib import Path

import pytest

from ddppipe import download, mnist
from tests.tiny import TinyData


def copy_mirror(tiny: TinyData, dest: Path) -> Path:
    shutil.copytree(tiny.mirror, dest)
    return dest


def test_http_fail_over_to_the_next_mirror(
    tiny: TinyData, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken, good = http_mirror(empty), http_mirror(tiny.mirror)  # first one answers 404
    paths = download.download_all(tiny.sha256, [broken, good], tmp_path / "out", timeout=5)
    assert [p.name for p in paths] == list(mnist.FILES)
    for p in paths:
        assert p.read_bytes() == (tiny.data_dir / p.name).read_bytes()
    assert "404" in caplog.text and "trying the next mirror" in caplog.text
    assert mnist.load(tmp_path / "out").train.images.shape == (256, 28, 28)


def test_file_url_and_unreachable_host(tiny: TinyData, tmp_path: Path) -> None:
    dead = "http://127.0.0.1:9/"  # discard port: connection refused
    download.download_all(tiny.sha256, [dead, tiny.mirror_url], tmp_path / "out", timeout=5)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(mnist.FILES)


def test_corrupted_file_is_a_clear_error_and_leaves_nothing(
    tiny: TinyData, http_mirror, tmp_path: Path
) -> None:
    mirror = copy_mirror(tiny, tmp_path / "mirror")
    name = mnist.TRAIN_LABELS
    content = bytearray(gzip.decompress((mirror / f"{name}.gz").read_bytes()))
    content[-1] ^= 0xFF
    (mirror / f"{name}.gz").write_bytes(gzip.compress(bytes(content)))
    out = tmp_path / "out"
    with pytest.raises(download.DownloadError) as e:
        download.download_file(name, tiny.sha256[name], [http_mirror(mirror)], out, timeout=5)
    text = str(e.value)
    assert f"{name}: SHA-256 mismatch" in text
    assert f"expected {tiny.sha256[name]}, got {download.sha256(bytes(content))}" in text
    assert "data.mirrors" in text  # says what to do
    assert not out.exists() or not any(out.iterdir())


def test_truncated_gzip_is_named(tiny: TinyData, tmp_path: Path) -> None:
    mirror = copy_mirror(tiny, tmp_path / "mirror")
    name = mnist.TEST_IMAGES
    archive = (mirror / f"{name}.gz").read_bytes()
    (mirror / f"{name}.gz").write_bytes(archive[: len(archive) // 2])
    with pytest.raises(download.DownloadError, match=f"{name}: corrupt or truncated gzip"):
        download.download_file(name, tiny.sha256[name], [mirror.as_uri()], tmp_path / "out")
    assert not (tmp_path / "out" / name).exists()


def test_wrong_idx_layout_with_matching_checksum_is_rejected(tmp_path: Path) -> None:
    # A mirror whose checksum list matches a file that is not IDX at all.
    content = b"not an idx file at all"
    (tmp_path / f"{mnist.TEST_LABELS}.gz").write_bytes(gzip.compress(content))
    with pytest.raises(download.DownloadError, match="wrong IDX magic"):
        download.download_file(
            mnist.TEST_LABELS, download.sha256(content), [tmp_path.as_uri()], tmp_path / "out"
        )


def test_verified_file_is_kept(tiny: TinyData, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(tiny.data_dir / mnist.TRAIN_LABELS, out)
    # No mirror would work; the file is kept because its checksum is right.
    download.download_file(
        mnist.TRAIN_LABELS, tiny.sha256[mnist.TRAIN_LABELS], ["http://127.0.0.1:9/"], out, timeout=1
    )


def test_sha256_list_must_name_the_four_files(tiny: TinyData, tmp_path: Path) -> None:
    sums = dict(tiny.sha256)
    del sums[mnist.TEST_LABELS]
    with pytest.raises(download.DownloadError, match="missing: \\['t10k-labels-idx1-ubyte'\\]"):
        download.download_all(sums, [tiny.mirror_url], tmp_path)
