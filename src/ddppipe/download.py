"""Checksum-verified MNIST download from an ordered list of mirrors, with fail-over."""

from __future__ import annotations

import gzip
import hashlib
import logging
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddppipe import atomic, idx, mnist

log = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    """No mirror delivered a valid copy of a file."""


class ChecksumError(ValueError):
    """Downloaded content does not match its expected SHA-256."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def url_for(mirror: str, name: str) -> str:
    """The URL of ``name``'s gzip archive on ``mirror`` (http(s):// or file://)."""
    return f"{mirror.rstrip('/')}/{name}.gz"


def fetch(url: str, timeout: float) -> bytes:
    """Read the whole resource at ``url``; raises OSError (URLError included) on failure."""
    request = urllib.request.Request(url, headers={"User-Agent": "ddppipe"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def verified_content(name: str, archive: bytes, expected_sha256: str) -> bytes:
    """Decompress ``archive`` and check its SHA-256 and IDX layout; return the content."""
    try:
        content = gzip.decompress(archive)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ChecksumError(f"{name}: corrupt or truncated gzip archive ({e})") from e
    actual = sha256(content)
    if actual != expected_sha256.lower():
        raise ChecksumError(
            f"{name}: SHA-256 mismatch of the decompressed content: "
            f"expected {expected_sha256.lower()}, got {actual}"
        )
    idx.parse(content, name, mnist.expected_ndim(name))
    return content


def download_file(
    name: str, expected_sha256: str, mirrors: Sequence[str], dest_dir: Path, timeout: float = 60
) -> Path:
    """Fetch ``name`` from the first mirror that delivers valid content; write it atomically.

    An existing file with the right checksum is kept as it is.
    """
    dest = Path(dest_dir) / name
    if dest.is_file() and file_sha256(dest) == expected_sha256.lower():
        log.info("%s: already present and verified", dest)
        return dest
    if not mirrors:
        raise DownloadError(f"{name}: no mirrors configured (config key data.mirrors is empty)")
    failures: list[str] = []
    for mirror in mirrors:
        url = url_for(mirror, name)
        try:
            content = verified_content(name, fetch(url, timeout), expected_sha256)
        except (OSError, ValueError) as e:
            log.warning("%s: %s; trying the next mirror", url, e)
            failures.append(f"{url}: {e}")
            continue
        atomic.write_bytes(dest, content)
        log.info("%s: downloaded from %s and verified", dest, url)
        return dest
    raise DownloadError(
        f"could not download {name} from any of {len(mirrors)} mirror(s):\n  "
        + "\n  ".join(failures)
        + "\nPoint data.mirrors at a reachable mirror, e.g. "
        "`snakemake --config 'data={mirrors: [file:///path/to/mnist/]}'`, "
        "or check data.sha256 if the mirror serves different content."
    )


def download_all(
    sha256s: Mapping[str, str], mirrors: Sequence[str], dest_dir: Path, timeout: float = 60
) -> list[Path]:
    """Download every file of ``sha256s`` (name -> SHA-256 of the decompressed content)."""
    unknown = sorted(set(sha256s) - set(mnist.FILES))
    missing = sorted(set(mnist.FILES) - set(sha256s))
    if unknown or missing:
        raise DownloadError(
            f"data.sha256 must list exactly {', '.join(mnist.FILES)}; "
            f"unknown: {unknown or 'none'}, missing: {missing or 'none'}"
        )
    return [download_file(n, sha256s[n], mirrors, dest_dir, timeout) for n in mnist.FILES]
