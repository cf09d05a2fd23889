"""Checksum-verified MNIST download from an ordered list of mirrors, with fail-over.

Each file is streamed: read in chunks, gunzipped incrementally, hashed and checked (IDX header,
exact length, SHA-256) as it arrives, written to a temporary file next to its destination and
renamed into place only once every check passes. Compressed and decompressed sizes are capped
per file and each attempt has an overall deadline, so a gzip bomb, an endless body or a
slow-drip server costs bounded memory and time before the next mirror is tried.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import time
import urllib.request
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.core.hashing import file_sha256
from ddppipe.data import idx, mnist_files

log = logging.getLogger(__name__)

# Decompressed sizes of the MNIST files: the default caps (config key task_args.max_bytes).
MAX_BYTES = {
    mnist_files.TRAIN_IMAGES: 47_040_016,
    mnist_files.TRAIN_LABELS: 60_008,
    mnist_files.TEST_IMAGES: 7_840_016,
    mnist_files.TEST_LABELS: 10_008,
}
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_DEADLINE_S = 600.0
READ_CHUNK = 1 << 16  # compressed bytes per read
INFLATE_CHUNK = 1 << 20  # most decompressed bytes produced at once
MAX_HEADER = 4 + 4 * idx.IMAGES_NDIM


class DownloadError(RuntimeError, UserError):
    """No mirror delivered a valid copy of a file."""


class ChecksumError(ValueError):
    """Downloaded content does not match its expected SHA-256."""


class LimitError(ValueError):
    """A mirror exceeded a size cap or the deadline of one file's download."""


class MirrorError(ValueError):
    """A mirror is unreachable, answered an HTTP error or broke the connection."""


@dataclass(frozen=True)
class Limits:
    """Bounds of one file's download from one mirror."""

    max_bytes: int  # decompressed size cap
    deadline_s: float = DEFAULT_DEADLINE_S  # overall, across reads
    timeout_s: float = DEFAULT_TIMEOUT_S  # per connection attempt and read

    @property
    def max_compressed(self) -> int:
        """Cap on the bytes read: gzip grows incompressible data by far less than 1%."""
        return self.max_bytes + self.max_bytes // 100 + 4096


def url_for(mirror: str, name: str) -> str:
    """The URL of ``name``'s gzip archive on ``mirror`` (http(s):// or file://)."""
    return f"{mirror.rstrip('/')}/{name}.gz"


class _Inflater:
    """Incremental gunzip into ``out`` that caps the size, hashes and checks the IDX layout."""

    def __init__(self, name: str, out: BinaryIO, max_bytes: int) -> None:
        self.name, self.out, self.max_bytes = name, out, max_bytes
        self.inflate = zlib.decompressobj(wbits=31)  # gzip only
        self.sha = hashlib.sha256()
        self.size = 0
        self.head = b""
        self.header: idx.IdxHeader | None = None

    def feed(self, data: bytes) -> None:
        try:
            while data:
                if self.inflate.eof:
                    raise ChecksumError(f"{self.name}: corrupt gzip archive: data after its end")
                self._take(self.inflate.decompress(data, INFLATE_CHUNK))
                data = self.inflate.unconsumed_tail or self.inflate.unused_data
        except zlib.error as e:
            raise ChecksumError(f"{self.name}: corrupt or truncated gzip archive ({e})") from e

    def finish(self) -> str:
        """Check that the stream is complete and as long as its header says; return SHA-256."""
        self._take(self.inflate.flush())
        if not self.inflate.eof:
            raise ChecksumError(f"{self.name}: corrupt or truncated gzip archive (ends early)")
        header = self.header or self._check_header()
        if self.size != header.size:
            raise idx.IdxError(
                f"{self.name}: wrong size for count {header.dims[0]}: expected {header.size:,} "
                f"bytes, got {self.size:,} (truncated or padded file)"
            )
        return self.sha.hexdigest()

    def _take(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.max_bytes:
            raise LimitError(
                f"decompressed size exceeds the cap of {self.max_bytes:,} bytes "
                "(task_args.max_bytes)"
            )
        if self.header is None and len(self.head) < MAX_HEADER:
            self.head += piece[: MAX_HEADER - len(self.head)]
            if len(self.head) == MAX_HEADER:
                self._check_header()
        if self.header is not None and self.size > self.header.size:
            raise idx.IdxError(
                f"{self.name}: longer than the {self.header.size:,} bytes its IDX header announces"
            )
        self.sha.update(piece)
        self.out.write(piece)

    def _check_header(self) -> idx.IdxHeader:
        header = idx.read_header(self.head, self.name)
        ndim = mnist_files.expected_ndim(self.name)
        if len(header.dims) != ndim:
            raise idx.IdxError(
                f"{self.name}: wrong IDX magic: expected 0x0000080{ndim}, "
                f"got 0x0000080{len(header.dims)}"
            )
        if ndim == idx.IMAGES_NDIM and header.dims[1:] != idx.IMAGE_SHAPE:
            raise idx.IdxError(
                f"{self.name}: wrong image shape: expected 28x28, "
                f"got {header.dims[1]}x{header.dims[2]}"
            )
        if header.size > self.max_bytes:
            raise LimitError(
                f"the IDX header announces {header.size:,} bytes, above the cap of "
                f"{self.max_bytes:,} bytes (task_args.max_bytes)"
            )
        self.header = header
        return header


@contextmanager
def _mirror_errors(timeout_s: float) -> Iterator[None]:
    """Turn the transport errors of a mirror into MirrorError (local disk errors stay OSError)."""
    try:
        yield
    except (OSError, http.client.HTTPException) as e:
        timed_out = isinstance(e, TimeoutError) or isinstance(
            getattr(e, "reason", None), TimeoutError
        )
        hint = f" (no answer within task_args.timeout_s = {timeout_s:g} s)" if timed_out else ""
        raise MirrorError(f"{e}{hint}") from e


def fetch_verified(url: str, name: str, expected_sha256: str, dest: Path, limits: Limits) -> None:
    """Stream ``url`` gunzipped into ``dest``, checking everything on the way.

    Raises a ValueError (MirrorError, LimitError, ChecksumError, IdxError) for what the mirror
    did wrong, OSError for local trouble; ``dest`` then holds a partial file to discard.
    """
    deadline = time.monotonic() + limits.deadline_s
    request = urllib.request.Request(url, headers={"User-Agent": "ddppipe"})
    timeout = min(limits.timeout_s, limits.deadline_s)
    with _mirror_errors(timeout):
        response = urllib.request.urlopen(request, timeout=timeout)
    with response, open(dest, "wb") as out:
        length = response.headers.get("Content-Length", "")
        announced = int(length) if length.isdigit() else None  # http.client ignores others too
        if announced is not None and announced > limits.max_compressed:
            raise LimitError(
                f"Content-Length {announced:,} exceeds the compressed-size cap of "
                f"{limits.max_compressed:,} bytes (task_args.max_bytes + 1% + 4 KiB)"
            )
        inflater = _Inflater(name, out, limits.max_bytes)
        received = 0
        while True:
            if time.monotonic() > deadline:
                raise LimitError(
                    f"not complete within the deadline of {limits.deadline_s:g} s "
                    f"(task_args.deadline_s); {received:,} bytes received"
                )
            with _mirror_errors(timeout):
                chunk = response.read1(READ_CHUNK)  # what has arrived: no slow-drip stall
            if not chunk:
                break
            received += len(chunk)
            if received > limits.max_compressed:
                raise LimitError(
                    f"compressed size exceeds the cap of {limits.max_compressed:,} bytes "
                    "(task_args.max_bytes + 1% + 4 KiB)"
                )
            inflater.feed(chunk)
        if announced is not None and received != announced:
            raise MirrorError(
                f"truncated body: got {received:,} of the {announced:,} bytes of its Content-Length"
            )
        actual = inflater.finish()
    if actual != expected_sha256.lower():
        raise ChecksumError(
            f"{name}: SHA-256 mismatch of the decompressed content: "
            f"expected {expected_sha256.lower()}, got {actual}"
        )


def download_file(
    name: str, expected_sha256: str, mirrors: Sequence[str], dest_dir: Path, limits: Limits
) -> Path:
    """Fetch ``name`` from the first mirror that delivers valid content; write it atomically.

    An existing file with the right checksum is kept as it is.
    """
    dest = Path(dest_dir) / name
    if dest.is_file() and file_sha256(dest) == expected_sha256.lower():
        log.info("%s: already present and verified", dest)
        return dest
    if not mirrors:
        raise DownloadError(f"{name}: no mirrors configured (task_args.mirrors is empty)")
    failures: list[str] = []
    for mirror in mirrors:
        url = url_for(mirror, name)
        try:
            with atomic.atomic_path(dest) as tmp:
                fetch_verified(url, name, expected_sha256, tmp, limits)
        except ValueError as e:  # the mirror's fault; a local OSError (disk full) propagates
            log.warning("%s: %s; trying the next mirror", url, e)
            failures.append(f"{url}: {e}")
            continue
        log.info("%s: downloaded from %s and verified", dest, url)
        return dest
    raise DownloadError(
        f"could not download {name} from any of {len(mirrors)} mirror(s):\n  "
        + "\n  ".join(failures)
        + "\nPoint task_args.mirrors at a reachable mirror, e.g. "
        "`snakemake --config 'task_args={mirrors: [file:///path/to/mnist/]}'`, "
        "check task_args.sha256 if the mirror serves different content, "
        "or raise task_args.max_bytes or task_args.deadline_s if a limit is too tight."
    )


def download_all(data: Mapping[str, Any], dest_dir: Path) -> list[Path]:
    """Download the MNIST files as the validated config section ``data`` describes."""
    sha256s: Mapping[str, str] = data["sha256"]
    caps = {**MAX_BYTES, **data.get("max_bytes", {})}
    unknown = sorted((set(sha256s) | set(caps)) - set(mnist_files.FILES))
    missing = sorted(set(mnist_files.FILES) - set(sha256s))
    if unknown or missing:
        raise DownloadError(
            f"task_args.sha256 must list exactly {', '.join(mnist_files.FILES)} (and "
            f"task_args.max_bytes only these); unknown: {unknown or 'none'}, "
            f"missing: {missing or 'none'}"
        )
    deadline_s = data.get("deadline_s", DEFAULT_DEADLINE_S)
    timeout_s = data.get("timeout_s", DEFAULT_TIMEOUT_S)
    limits = {n: Limits(caps[n], deadline_s, timeout_s) for n in mnist_files.FILES}
    return [
        download_file(n, sha256s[n], data["mirrors"], dest_dir, limits[n])
        for n in mnist_files.FILES
    ]
