"""The local worker group (ddppipe.launching.workers): torchrun's variables, a failure stops the
others, restarts, and a stop is never restarted. Its workers here are small Python programs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ddppipe.core import slot
from ddppipe.launching import workers
from ddppipe.runstate import failures

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


# A user's script (run as the launcher runs one): rank 1 raises in every start of the group.
ALWAYS_FAILS = """
import os, time


def step(n):
    raise ValueError(f"no batch {n}")


if os.environ["RANK"] == "1":
    step(7)
time.sleep(60)
"""


def test_the_same_failure_again_is_not_restarted(tmp_path: Path) -> None:
    """The group restarts after a failure, but not after the same failure (exception, line of
    the user's script) twice: restarts are for transient faults. Each start's first failure is
    recorded (rank, exception, the script's frame)."""
    script = tmp_path / "train.py"
    script.write_text(ALWAYS_FAILS)
    record = slot.Slot("script", str(tmp_path), user_file=str(script))
    env = {"PATH": "/usr/bin:/bin", **slot.write(record, tmp_path / "slot.json")}
    runner = [sys.executable, "-m", "ddppipe.training.script.run_script", str(script)]
    line = 1 + ALWAYS_FAILS.splitlines().index('    raise ValueError(f"no batch {n}")')
    g = workers.Group(runner, env, 2, 3)
    assert g.wait() == 1
    assert g.restarts == 1  # started twice: the second start failed the same way
    found = [failures.first_of_restart(tmp_path / "failures", r) for r in (0, 1)]
    assert [(f.rank, f.type, f.message, f.frame) for f in found if f] == [
        (1, "ValueError", "no batch 7", f"{script}:{line} (in step)")
    ] * 2  # fmt: skip
