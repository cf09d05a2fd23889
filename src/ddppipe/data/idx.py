"""Reading, validating and writing IDX files (the MNIST container format)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the header checks (the download) need no torch
    import torch

from ddppipe.core.errors import UserError

UBYTE = 0x08
IMAGES_NDIM = 3
LABELS_NDIM = 1
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10


class IdxError(ValueError, UserError):
    """An IDX file is malformed or does not have the expected layout."""


@dataclass(frozen=True)
class IdxHeader:
    """The parsed header of an IDX file."""

    dtype_code: int
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of bytes the header announces, header included."""
        n = 1
        for d in self.dims:
            n *= d
        return 4 + 4 * len(self.dims) + n


def read_header(data: bytes, name: str) -> IdxHeader:
    """Parse and check the IDX header of ``data``; ``name`` is used in error messages."""
    if len(data) < 4:
        raise IdxError(f"{name}: too short for an IDX header: expected >= 4 bytes, got {len(data)}")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != UBYTE or ndim not in (IMAGES_NDIM, LABELS_NDIM):
        raise IdxError(
            f"{name}: wrong IDX magic: expected 0x0000080{IMAGES_NDIM} (images) or "
            f"0x0000080{LABELS_NDIM} (labels), got 0x{data[:4].hex()}"
        )
    if len(data) < 4 + 4 * ndim:
        raise IdxError(f"{name}: truncated IDX header: {len(data)} bytes for {ndim} dimensions")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return IdxHeader(dtype_code, dims)


def parse(data: bytes, name: str, expect_ndim: int | None = None) -> torch.Tensor:
    """Parse an unsigned-byte IDX file into a uint8 tensor, checking magic, size and shape."""
    import torch

    header = read_header(data, name)
    if expect_ndim is not None and len(header.dims) != expect_ndim:
        raise IdxError(
            f"{name}: wrong IDX magic: expected 0x0000080{expect_ndim}, "
            f"got 0x0000080{len(header.dims)}"
        )
    if len(data) != header.size:
        raise IdxError(
            f"{name}: wrong size for count {header.dims[0]}: expected {header.size} bytes, "
            f"got {len(data)} (truncated or padded file)"
        )
    if len(header.dims) == IMAGES_NDIM and tuple(header.dims[1:]) != IMAGE_SHAPE:
        raise IdxError(
            f"{name}: wrong image shape: expected {IMAGE_SHAPE[0]}x{IMAGE_SHAPE[1]}, "
            f"got {header.dims[1]}x{header.dims[2]}"
        )
    offset = 4 + 4 * len(header.dims)
    flat = torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8)
    tensor = flat.reshape(header.dims)
    if len(header.dims) == LABELS_NDIM and tensor.numel() and int(tensor.max()) >= NUM_CLASSES:
        raise IdxError(
            f"{name}: label out of range: expected 0..{NUM_CLASSES - 1}, got {int(tensor.max())}"
        )
    return tensor


def encode(tensor: torch.Tensor) -> bytes:
    """Encode a uint8 tensor (N,) or (N, 28, 28) as IDX bytes."""
    import torch

    if tensor.dtype != torch.uint8:
        raise TypeError(f"IDX encoding needs a uint8 tensor, got {tensor.dtype}")
    header = struct.pack(">HBB", 0, UBYTE, tensor.dim()) + struct.pack(
        f">{tensor.dim()}I", *tensor.shape
    )
    return header + tensor.contiguous().numpy().tobytes()


def read(path: Path, expect_ndim: int | None = None) -> torch.Tensor:
    """Read and parse an IDX file from disk."""
    return parse(Path(path).read_bytes(), str(path), expect_ndim)
