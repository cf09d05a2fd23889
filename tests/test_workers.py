"""The local worker group (ddppipe.launching.workers): torchrun's variables, a failure stops the
others, restarts, and a stop is never restarted. Its workers here are small Python programs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ddppipe.launching import workers

# Rank 1 fails with exit 3 in the group's first start; the others wait for a minute.
FAIL_ONCE = """
import os, sys, time
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(60)
"""


def group(program: str, nproc: int, max_restarts: int) -> workers.Group:
    return workers.Group([sys.executable, "-c", program], {"PATH": "/usr/bin:/bin"}, nproc,
                         max_restarts)  # fmt: skip


def test_every_rank_gets_torchruns_variables(tmp_path: Path) -> None:
    program = f"""
import json, os
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join({str(tmp_path)!r}, os.environ["RANK"]), "w") as f:
    json.dump({{k: os.environ[k] for k in keys}}, f)
"""
    assert group(program, 3, 0).wait() == 0
    seen = [json.loads((tmp_path / str(rank)).read_text()) for rank in range(3)]
    assert [s["RANK"] for s in seen] == [s["LOCAL_RANK"] for s in seen] == ["0", "1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {s["LOCAL_WORLD_SIZE"] for s in seen} == {"3"}
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1


def test_a_failed_rank_stops_the_others_and_the_group_restarts() -> None:
    started = time.monotonic()
    g = group(FAIL_ONCE, 3, 1)
    assert g.wait() == 0
    assert g.restarts == 1
    assert time.monotonic() - started < 20  # not the survivors' minute


def test_without_restarts_left_the_first_failure_is_the_groups() -> None:
    g = group(FAIL_ONCE, 2, 0)
    assert g.wait() == 3
    assert g.procs[0].returncode == -15  # the survivor got SIGTERM


def test_a_stop_is_never_restarted() -> None:
    g = group("import sys; sys.exit(75)", 2, 3)
    assert g.wait() == 75
    assert g.restarts == 0
