"""Shared fixtures: tiny generated data, a loopback HTTP mirror, and running the CLI."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import documented_build
from tests.slurm_fixtures import slurm_accounting_cluster, slurm_cluster, slurm_slot  # noqa: F401
from tests.tiny import REPO, TinyData, make_tiny

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the SLURM test cluster or with Apptainer is slow too: `-m "not slow"` (the
    quick loop of docs/tests.md) leaves it out."""
    for item in items:
        marked = any(item.get_closest_marker(name) for name in ("slurm", "apptainer"))
        if marked or "slurm_slot" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def shared_build(
    tiny: TinyData, tmp_path_factory: pytest.TempPathFactory
) -> documented_build.Build:
    """Every documented command run once on tiny data: the local DAG's one build that the
    end-to-end tests share (tests/documented_build.py says who asserts what on it)."""
    return documented_build.build(tiny, tmp_path_factory.mktemp("documented"))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_mirror() -> Iterator:
    """Start a loopback HTTP server for a folder: ``url = http_mirror(folder)``."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(folder: Path) -> str:
        handler = functools.partial(QuietHandler, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def run_cli(
    *args: str,
    cwd: Path = REPO,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``python -m ddppipe ARGS`` and return the finished process (text output)."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"ddppipe {args} failed ({result.returncode}):\n{result.stderr}")
    return result
