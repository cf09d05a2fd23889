import struct

import pytest
import torch

from ddppipe.data import idx


def images(n: int = 5) -> torch.Tensor:
    return (
        torch.arange(n * 28 * 28, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, 28, 28)
    )


def test_roundtrip_images_and_labels() -> None:
    x = images()
    assert torch.equal(idx.parse(idx.encode(x), "x", idx.IMAGES_NDIM), x)
    y = torch.tensor([0, 9, 3], dtype=torch.uint8)
    assert torch.equal(idx.parse(idx.encode(y), "y", idx.LABELS_NDIM), y)


def test_header_layout_matches_the_mnist_format() -> None:
    data = idx.encode(images(2))
    assert data[:4] == b"\x00\x00\x08\x03"
    assert struct.unpack(">3I", data[4:16]) == (2, 28, 28)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00\x00\x08", "too short"),
        (b"\x00\x00\x0d\x03" + bytes(12), "wrong IDX magic: expected .* got 0x00000d03"),
        (idx.encode(images(2))[:-1], r"expected 1584 bytes, got 1583"),
        (idx.encode(images(2)) + b"\x00", r"expected 1584 bytes, got 1585"),
        (
            b"\x00\x00\x08\x03" + struct.pack(">3I", 1, 32, 32) + bytes(1024),
            "expected 28x28, got 32x32",
        ),
        (idx.encode(torch.tensor([1, 10], dtype=torch.uint8)), "expected 0..9, got 10"),
    ],
)
def test_bad_files_name_expected_and_actual(data: bytes, message: str) -> None:
    with pytest.raises(idx.IdxError, match=f"^bad-file: .*{message}"):
        idx.parse(data, "bad-file")


def test_labels_where_images_are_expected() -> None:
    labels = idx.encode(torch.tensor([1, 2], dtype=torch.uint8))
    with pytest.raises(idx.IdxError, match="expected 0x00000803, got 0x00000801"):
        idx.parse(labels, "train-images-idx3-ubyte", idx.IMAGES_NDIM)
