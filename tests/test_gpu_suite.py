"""`make test-gpu` where there is no GPU (CI): it refuses in one line and runs nothing; its
plan fits its budget on one GPU; each GPU test skips with its reason; the budget and the report
work as they will on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import gpu_plan, gpu_suite
from tests.tiny import REPO


def test_without_a_gpu_make_test_gpu_says_so_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """The README's GPU command on a machine whose torch sees no GPU (hidden here, should this
    machine have one): exit 2, one line of its own, no report."""
    out = tmp_path / "suite"
    result = subprocess.run(
        ["make", "-s", "test-gpu", f"GPU_SUITE_ARGS=--out {out}"], cwd=REPO, text=True,
        capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    own = [line for line in result.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)]
    assert own == [gpu_suite.NO_GPU_LINE], result.stderr
    assert result.stdout == ""
    assert not out.exists()


def test_the_suite_runs_its_plan_and_reports_every_test_skipped_here(tmp_path: Path) -> None:
    """The runner's pytest session on this GPU-less machine: the plan printed (each test's
    expected time and GPUs; one GPU's share within the 8-minute budget), every GPU test
    skipped with its reason, the report written with each and the stack."""
    out = tmp_path / "suite"
    code = gpu_suite.run(gpu_suite.BUDGET_S, out, [])
    assert code == 0
    log = (out / "log.txt").read_text()
    planned = re.findall(r"^\s+(\d+) s  (\d) GPU\(s\)  (\S+)  \[skip: needs a CUDA GPU\]$", log,
                         re.M)  # fmt: skip
    on_one_gpu = sum(int(s) for s, gpus, _ in planned if gpus == "1")
    assert len(planned) >= 18 and on_one_gpu <= 480, (on_one_gpu, log[:3000])
    report = json.loads((out / "report.json").read_text())
    assert report["budget_s"] == 480 and "torch" in report["machine"]
    assert {p["outcome"] for p in report["parts"]} == {"skipped"}
    assert {p["reason"] for p in report["parts"]} == {"needs a CUDA GPU"}
    assert sorted(p["test"] for p in report["parts"]) == sorted(t for _, _, t in planned)
    assert report["counts"] == {"skipped": len(planned)}


def test_a_test_for_more_gpus_than_there_are_skips_naming_both() -> None:
    one = gpu_plan.part("t::a", {"seconds": 25, "gpus": 2}, gpus_here=1, cuda=True)
    assert one.skip == "needs 2 GPUs; this machine has 1"
    assert gpu_plan.part("t::a", {"seconds": 25, "gpus": 2}, 2, True).skip is None
    assert gpu_plan.part("t::b", {"seconds": 5}, 0, False).skip == "needs a CUDA GPU"
    with pytest.raises(pytest.UsageError, match=r"t::c: say its expected time"):
        gpu_plan.part("t::c", {}, 1, True)


def test_a_part_starts_only_if_its_expected_time_fits_what_is_left(tmp_path: Path) -> None:
    """100 s of budget from t=1000: a 30-s part starts at t=1060, not at t=1080 (20 s left),
    when a 20-s part still starts; the report records it as not reached, whole after each
    change."""
    budget = gpu_plan.Budget(100, started=1000.0)
    part = gpu_plan.Part("t::long", 30)
    assert budget.refusal(part, now=1060.0) is None
    refusal = budget.refusal(part, now=1080.0)
    assert refusal == "not reached: expects 30 s, 20 s of the budget left"
    assert budget.refusal(gpu_plan.Part("t::short", 20), now=1080.0) is None
    assert budget.refusal(gpu_plan.Part("t::short", 20), now=1200.0) == (
        "not reached: expects 20 s, 0 s of the budget left"
    )
    parts = [part, gpu_plan.Part("t::ok", 10), gpu_plan.Part("t::two", 5, 2, "needs 2 GPUs")]
    report = gpu_plan.Report(tmp_path / "r.json", 100, parts, {"gpus": ["X"]})
    report.record("t::ok", outcome="passed", duration_s=9.5, figures={"images_per_s": 1e5})
    report.record("t::long", outcome=gpu_plan.NOT_REACHED, reason=refusal)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["counts"] == {"not reached": 1, "passed": 1, "skipped": 1}
    assert [(p["test"], p["outcome"], p["figures"]) for p in written["parts"]] == [
        ("t::long", "not reached", {}), ("t::ok", "passed", {"images_per_s": 1e5}),
        ("t::two", "skipped", {}),
    ]  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no draft left


def test_a_session_stopped_at_the_budget_reports_what_it_did_not_reach(tmp_path: Path) -> None:
    parts = [gpu_plan.Part("t::a", 30), gpu_plan.Part("t::b", 20)]
    report = gpu_plan.Report(tmp_path / "report.json", 60, parts, {})
    report.record("t::a", outcome="passed", duration_s=31.0)
    gpu_suite.summarize(tmp_path / "report.json", 124)
    parts = json.loads((tmp_path / "report.json").read_text())["parts"]
    assert [(p["outcome"], p["reason"]) for p in parts] == [
        ("passed", ""), ("not reached", "stopped at the budget")
    ]  # fmt: skip
