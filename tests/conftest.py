"""Shared fixtures: tiny generated data, a loopback HTTP mirror, a process group of this
process alone, and running the CLI."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.launching import warm
from tests import documented_build
from tests.container_fixtures import image_run, image_workdir  # noqa: F401
from tests.slurm_fixtures import slurm_accounting_cluster, slurm_cluster, slurm_slot  # noqa: F401
from tests.tiny import REPO, TinyData, make_tiny

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The GPU tests' plan, skips and budget (`make test-gpu`): @pytest.mark.gpu(seconds=N, gpus=K).
pytest_plugins = ["tests.gpu_plan"]


GROUPS_ENV = "DDPPIPE_TEST_GROUPS"  # the file of each test's group (pytest-xdist, below)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on the SLURM test cluster, with Apptainer or on the shared build of the local DAG
    is slow too: `make test-quick` (`-m "not slow"`, the inner loop of docs/tests.md) leaves it
    out, as it leaves out every test marked slow by hand (a Snakemake DAG of its own, more
    than one training run: over 2 fresh interpreters importing torch).

    Under pytest-xdist (``make test``: ``-n 2``) each test is in a group that one worker runs
    whole, in order (:func:`pytest_xdist_make_scheduler`): the SLURM test cluster's tests (one
    cluster per machine; mostly waiting for SLURM) in one, beside the image's (the files that
    take turns in its working directory: tests/container_fixtures.py), the shared DAG build's
    end-to-end tests and every other file's tests (mostly computing). The cluster test that runs
    in an image comes last, when the image is long built by the other worker
    (tests/across_workers.py)."""
    groups, in_image = {}, []
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        marked = any(item.get_closest_marker(name) for name in ("slurm", "apptainer"))
        if marked or fixtures & {"slurm_slot", "shared_build"}:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slurm") or "slurm_slot" in fixtures:
            groups[item.nodeid] = "cluster"
            if "image_run" in fixtures:
                in_image.append(item)
        elif "shared_build" in fixtures:
            groups[item.nodeid] = "shared_build"
        elif "image_workdir" in fixtures:  # the image's tests, in its working directory in turns
            groups[item.nodeid] = "image"
        else:
            groups[item.nodeid] = item.nodeid.split("::")[0]
    items[:] = [i for i in items if i not in in_image] + in_image
    if hasattr(config, "workerinput") and os.environ.get(GROUPS_ENV):  # a worker's collection
        path = Path(os.environ[GROUPS_ENV])
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        draft.write_text(json.dumps(groups))
        os.replace(draft, path)


GROUPS_FILE = pytest.StashKey[Path]()  # the groups file this session made (and removes)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        handle, path = tempfile.mkstemp(prefix="ddppipe-test-groups-", suffix=".json")
        os.close(handle)
        os.environ[GROUPS_ENV] = path  # (the workers inherit it)
        config.stash[GROUPS_FILE] = Path(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this session's groups file; not one a session it runs in made (the shared
    build's `make test-quick TESTS=...` inherits the variable). The session's last process
    (not an xdist worker) ends the warm servers its local calls kept for later calls
    (ddppipe.launching.warm.KEEP_S): no test's process outlives the session."""
    if GROUPS_FILE in config.stash:
        config.stash[GROUPS_FILE].unlink(missing_ok=True)
        os.environ.pop(GROUPS_ENV, None)
    if not hasattr(config, "workerinput"):
        end_kept_warm_servers()


def end_kept_warm_servers() -> None:
    """SIGTERM to this user's warm servers kept between calls (``ddppipe warm-server --socket
    .../ddppipe-warm-kept-*.sock``)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            mine = proc.stat().st_uid == os.getuid()
        except OSError:
            continue
        kept = any(warm.KEPT_PREFIX.encode() in a and a.endswith(b".sock") for a in argv)
        if mine and b"warm-server" in argv and kept:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGTERM)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler by scope, each test's scope its group (the workers wrote them
    when they collected; xdist's own ``--dist loadgroup`` does not group under pytest 9: it
    sets ``item._nodeid``, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "_groups"):
                self._groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
            return self._groups.get(nodeid, nodeid)

    return ByGroup(config, log)


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
def one_rank() -> Iterator[None]:
    """A process group of this process alone (gloo)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m ddppipe ARGS`` and return the finished process (text output);
    ``preexec_fn`` runs in the child before it starts (say, to enter a cgroup)."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"ddppipe {args} failed ({result.returncode}):\n{result.stderr}")
    return result


def prepare_in_process(settings: Path, dest: Path) -> None:
    """``ddppipe prepare --settings=SETTINGS --dest=DEST`` in this process: the command's own
    function, without a fresh interpreter importing torch (~3 CPU-seconds)."""
    from ddppipe.cli.commands import tasks as data_command

    assert data_command.prepare(settings, dest) == 0
