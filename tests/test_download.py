import contextlib
import gzip
import http.server
import json
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddppipe.core import hashing
from ddppipe.data import download, mnist_files
from tests.tiny import TinyData

# A server that is never cut off would hang the old read-it-all code: fail instead.
pytestmark = pytest.mark.timeout(60)

Respond = Callable[[http.server.BaseHTTPRequestHandler, threading.Event], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Respond], str]]:
    """Start a loopback HTTP server whose GET handler is ``respond``: ``url = serve(respond)``."""
    servers: list[http.server.ThreadingHTTPServer] = []
    stop = threading.Event()  # ends endless responses at teardown

    def start(respond: Respond) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    respond(self, stop)  # a client that gives up, as it should, raises these

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    stop.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def send_head(h: http.server.BaseHTTPRequestHandler, length: int | None = None) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/gzip")
    if length is not None:
        h.send_header("Content-Length", str(length))
    h.end_headers()


def gzip_bomb(header: bytes, mib: int) -> Iterator[bytes]:
    """Stream a gzip of ``header`` and ``mib`` MiB of zeros at about 1 KiB per MiB.

    After a full flush the compressor's output for 1 MiB of zeros is the same every time, so
    the bomb is made once per MiB-block, never held decompressed. No trailer: it never ends.
    """
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    yield deflate.compress(header) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(bytes(1 << 20)) + deflate.flush(zlib.Z_FULL_FLUSH)
    assert len(block) < 2048
    for _ in range(mib):
        yield block


def data_config(tiny: TinyData, mirrors: list[str], **extra: Any) -> dict[str, Any]:
    """The ``data`` config section for ``tiny``, capped at the tiny files' real sizes."""
    sizes = {n: (tiny.data_dir / n).stat().st_size for n in mnist_files.FILES}
    return {"mirrors": mirrors, "sha256": tiny.sha256, "max_bytes": sizes, **extra}


def assert_only_complete_files(out: Path, names: list[str]) -> None:
    """``out`` holds exactly ``names``: no temporary or partial file is left behind."""
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert left == sorted(names)


def copy_mirror(tiny: TinyData, dest: Path) -> Path:
    shutil.copytree(tiny.mirror, dest)
    return dest


def test_http_fail_over_to_the_next_mirror(
    tiny: TinyData, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken, good = http_mirror(empty), http_mirror(tiny.mirror)  # first one answers 404
    data = {"mirrors": [broken, good], "sha256": tiny.sha256, "timeout_s": 5}
    paths = download.download_all(data, tmp_path / "out")
    assert [p.name for p in paths] == [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    for p in paths:
        assert p.read_bytes() == (tiny.data_dir / p.name).read_bytes()
    assert "404" in caplog.text and "trying the next mirror" in caplog.text
    assert mnist_files.load(tmp_path / "out").train.images.shape == (256, 28, 28)


def test_file_url_and_unreachable_host(tiny: TinyData, tmp_path: Path) -> None:
    dead = "http://127.0.0.1:9/"  # discard port: connection refused
    download.download_all(data_config(tiny, [dead, tiny.mirror_url]), tmp_path / "out")
    assert_only_complete_files(tmp_path / "out", list(mnist_files.FILES))


def test_corrupted_file_is_a_clear_error_and_leaves_nothing(
    tiny: TinyData, http_mirror, tmp_path: Path
) -> None:
    mirror = copy_mirror(tiny, tmp_path / "mirror")
    name = mnist_files.TRAIN_LABELS
    content = bytearray(gzip.decompress((mirror / f"{name}.gz").read_bytes()))
    content[-1] ^= 0xFF
    (mirror / f"{name}.gz").write_bytes(gzip.compress(bytes(content)))
    out = tmp_path / "out"
    limits = download.Limits(len(content), timeout_s=5)
    with pytest.raises(download.DownloadError) as e:
        download.download_file(name, tiny.sha256[name], [http_mirror(mirror)], out, limits)
    text = str(e.value)
    assert f"{name}: SHA-256 mismatch" in text
    assert f"expected {tiny.sha256[name]}, got {hashing.sha256(bytes(content))}" in text
    assert "task_args.mirrors" in text  # says what to do
    assert not out.exists() or not any(out.iterdir())


def test_truncated_gzip_is_named(tiny: TinyData, tmp_path: Path) -> None:
    mirror = copy_mirror(tiny, tmp_path / "mirror")
    name = mnist_files.TEST_IMAGES
    archive = (mirror / f"{name}.gz").read_bytes()
    (mirror / f"{name}.gz").write_bytes(archive[: len(archive) // 2])
    with pytest.raises(download.DownloadError, match=f"{name}: corrupt or truncated gzip"):
        download.download_file(
            name, tiny.sha256[name], [mirror.as_uri()], tmp_path / "out", download.Limits(10**6)
        )
    assert_only_complete_files(tmp_path / "out", [])


def test_wrong_idx_layout_with_matching_checksum_is_rejected(tmp_path: Path) -> None:
    # A mirror whose checksum list matches a file that is not IDX at all.
    content = b"not an idx file at all"
    (tmp_path / f"{mnist_files.TEST_LABELS}.gz").write_bytes(gzip.compress(content))
    with pytest.raises(download.DownloadError, match="wrong IDX magic"):
        download.download_file(
            mnist_files.TEST_LABELS,
            hashing.sha256(content),
            [tmp_path.as_uri()],
            tmp_path / "out",
            download.Limits(10_008),
        )


def test_verified_file_is_kept(tiny: TinyData, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(tiny.data_dir / mnist_files.TRAIN_LABELS, out)
    # No mirror would work; the file is kept because its checksum is right.
    download.download_file(
        mnist_files.TRAIN_LABELS,
        tiny.sha256[mnist_files.TRAIN_LABELS],
        ["http://127.0.0.1:9/"],
        out,
        download.Limits(60_008, timeout_s=1),
    )


def test_sha256_list_must_name_the_four_files(tiny: TinyData, tmp_path: Path) -> None:
    sums = dict(tiny.sha256)
    del sums[mnist_files.TEST_LABELS]
    with pytest.raises(download.DownloadError, match="missing: \\['t10k-labels-idx1-ubyte'\\]"):
        download.download_all({"mirrors": [tiny.mirror_url], "sha256": sums}, tmp_path)


# A child process that tries one download and reports its peak memory above its baseline
# (taken after the imports; VmHWM is reset first where the kernel allows). RLIMIT_DATA keeps
# a regression from exhausting the machine: it fails with MemoryError instead.
BOMB_CHILD = """
import json, resource, sys
from pathlib import Path
from ddppipe.data import download

def kib(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1])

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
baseline = kib("VmHWM")
_, hard = resource.getrlimit(resource.RLIMIT_DATA)
resource.setrlimit(resource.RLIMIT_DATA, ((kib("VmData") << 10) + (1 << 30), hard))
try:
    download.download_all(json.loads(sys.argv[1]), Path(sys.argv[2]))
    error = None
except download.DownloadError as e:
    error = str(e)
print(json.dumps({"baseline_kib": baseline, "peak_kib": kib("VmHWM"), "error": error}))
"""


def test_gzip_bomb_is_capped_in_small_memory(tiny: TinyData, serve, tmp_path: Path) -> None:
    # A valid train-images IDX header (60000 x 28 x 28), then 8 GiB of zeros: < 16 MiB sent.
    gib = 8
    header = struct.pack(">HBB3I", 0, 8, 3, 60_000, 28, 28)
    bomb_size = sum(len(chunk) for chunk in gzip_bomb(header, gib << 10))

    def bomb(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        send_head(h)  # no Content-Length: the body ends when the connection closes
        for chunk in gzip_bomb(header, gib << 10):
            if stop.is_set():
                break
            h.wfile.write(chunk)

    url = serve(bomb)
    data = {"mirrors": [url], "sha256": tiny.sha256}  # default caps: the real MNIST sizes
    out = tmp_path / "out"
    t0 = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", BOMB_CHILD, json.dumps(data), str(out)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert child.returncode == 0, child.stderr
    elapsed = time.monotonic() - t0
    report = json.loads(child.stdout)
    growth_mib = (report["peak_kib"] - report["baseline_kib"]) / 1024
    print(
        f"\ngzip bomb ({bomb_size:,} bytes inflating to {gib} GiB): peak memory "
        f"{growth_mib:.1f} MiB above the baseline of {report['baseline_kib'] / 1024:.0f} MiB; "
        f"attempt and interpreter start-up {elapsed:.1f} s"
    )
    cap = download.MAX_BYTES[mnist_files.TRAIN_IMAGES]
    assert (
        f"{url}{mnist_files.TRAIN_IMAGES}.gz: decompressed size exceeds the cap of {cap:,} bytes "
        "(task_args.max_bytes)" in report["error"]
    )
    assert growth_mib < 100
    assert_only_complete_files(out, [])


def test_endless_body_stops_at_the_compressed_cap(
    tiny: TinyData, serve, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A gzip header, then empty stored deflate blocks forever: valid, and inflates to nothing,
    # so only the cap on the compressed bytes ends it.
    gzip_header = gzip.compress(b"", mtime=0)[:10]

    def endless(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        send_head(h)
        h.wfile.write(gzip_header)
        while not stop.is_set():
            h.wfile.write(b"\x00\x00\x00\xff\xff" * 4096)

    url = serve(endless)
    out = tmp_path / "out"
    data = data_config(tiny, [url, http_mirror(tiny.mirror)], timeout_s=5)
    download.download_all(data, out)
    assert_only_complete_files(out, list(mnist_files.FILES))
    labels_cap = download.Limits(data["max_bytes"][mnist_files.TEST_LABELS]).max_compressed
    assert (
        f"{url}{mnist_files.TEST_LABELS}.gz: compressed size exceeds the cap of "
        f"{labels_cap:,} bytes" in caplog.text
    )


def test_content_length_above_the_cap_fails_before_reading(
    tiny: TinyData, serve, tmp_path: Path
) -> None:
    def huge(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        send_head(h, length=10**12)
        h.wfile.flush()
        stop.wait(30)  # sends no body: a client that reads would wait for timeout_s

    url = serve(huge)
    name = mnist_files.TEST_LABELS
    limits = download.Limits(10_008, deadline_s=30, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(download.DownloadError) as e:
        download.download_file(name, tiny.sha256[name], [url], tmp_path / "out", limits)
    assert time.monotonic() - t0 < 5
    assert (
        f"{url}{name}.gz: Content-Length 1,000,000,000,000 exceeds the compressed-size cap of "
        f"{limits.max_compressed:,} bytes" in str(e.value)
    )
    assert_only_complete_files(tmp_path / "out", [])


def test_slow_drip_is_abandoned_at_the_deadline(
    tiny: TinyData, serve, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = mnist_files.TEST_LABELS
    archive = (tiny.mirror / f"{name}.gz").read_bytes()
    sent = []

    def drip(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        if not h.path.endswith(f"{name}.gz"):
            h.send_error(404)
            return
        send_head(h, length=len(archive))
        for byte in archive:  # one byte a second: each read succeeds well within timeout_s
            h.wfile.write(bytes([byte]))
            h.wfile.flush()
            sent.append(byte)
            if stop.wait(1):
                return

    url = serve(drip)
    out = tmp_path / "out"
    data = data_config(tiny, [url, http_mirror(tiny.mirror)], timeout_s=5, deadline_s=2)
    t0 = time.monotonic()
    download.download_all(data, out)
    elapsed = time.monotonic() - t0
    print(f"\nslow drip abandoned after {elapsed:.1f} s, {len(sent)} of {len(archive)} bytes")
    assert elapsed < 2 + 2.5  # the deadline, plus at most one second-long read, plus slack
    assert f"{url}{name}.gz: not complete within the deadline of 2 s (task_args.deadline_s)" in (
        caplog.text
    )
    assert (out / name).read_bytes() == (tiny.data_dir / name).read_bytes()
    assert_only_complete_files(out, list(mnist_files.FILES))


def test_body_shorter_than_its_content_length_fails_over(
    tiny: TinyData, serve, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def short(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        archive = (tiny.mirror / Path(h.path).name).read_bytes()
        send_head(h, length=len(archive))
        h.wfile.write(archive[: len(archive) // 2])  # then the connection closes

    url = serve(short)
    out = tmp_path / "out"
    download.download_all(data_config(tiny, [url, http_mirror(tiny.mirror)], timeout_s=5), out)
    assert_only_complete_files(out, list(mnist_files.FILES))
    n = (tiny.mirror / f"{mnist_files.TEST_LABELS}.gz").stat().st_size
    assert (
        f"{url}{mnist_files.TEST_LABELS}.gz: truncated body: got {n // 2:,} of the {n:,} bytes "
        "of its Content-Length" in caplog.text
    )


@pytest.mark.parametrize("extra", [1, -1], ids=["padded", "short"])
def test_idx_length_must_match_its_header(
    tiny: TinyData, http_mirror, tmp_path: Path, extra: int
) -> None:
    # Content whose SHA-256 is listed but whose length differs from what its header announces.
    name = mnist_files.TEST_LABELS
    good = (tiny.data_dir / name).read_bytes()
    content = good + b"\x00" if extra > 0 else good[:-1]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / f"{name}.gz").write_bytes(gzip.compress(content))
    url = http_mirror(mirror)
    with pytest.raises(download.DownloadError) as e:
        download.download_file(
            name, hashing.sha256(content), [url], tmp_path / "out", download.Limits(10_008)
        )
    expected = (
        f"{name}: longer than the {len(good):,} bytes its IDX header announces"
        if extra > 0
        else f"{name}: wrong size for count 128: expected {len(good):,} bytes, got {len(content):,}"
    )
    assert f"{url}{name}.gz: {expected}" in str(e.value)
    assert_only_complete_files(tmp_path / "out", [])


def test_http_500_then_success_and_all_failures_named(
    tiny: TinyData, serve, http_mirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def error(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_error(500)

    def bomb(h: http.server.BaseHTTPRequestHandler, stop: threading.Event) -> None:
        send_head(h)
        header = (tiny.data_dir / mnist_files.TRAIN_IMAGES).read_bytes()[:16]
        for chunk in gzip_bomb(header, 64):
            h.wfile.write(chunk)

    failing, bombing = serve(error), serve(bomb)
    out = tmp_path / "out"
    download.download_all(data_config(tiny, [failing, http_mirror(tiny.mirror)]), out)
    assert_only_complete_files(out, list(mnist_files.FILES))
    assert f"{failing}{mnist_files.TRAIN_IMAGES}.gz: HTTP Error 500" in caplog.text

    with pytest.raises(download.DownloadError) as e:
        download.download_all(data_config(tiny, [failing, bombing]), tmp_path / "out2")
    text = str(e.value)
    cap = (tiny.data_dir / mnist_files.TRAIN_IMAGES).stat().st_size
    assert f"could not download {mnist_files.TRAIN_IMAGES} from any of 2 mirror(s)" in text
    assert f"{failing}{mnist_files.TRAIN_IMAGES}.gz: HTTP Error 500" in text
    assert (
        f"{bombing}{mnist_files.TRAIN_IMAGES}.gz: decompressed size exceeds the cap of "
        f"{cap:,} bytes (task_args.max_bytes)" in text
    )
    assert "raise task_args.max_bytes or task_args.deadline_s" in text
    assert_only_complete_files(tmp_path / "out2", [])
