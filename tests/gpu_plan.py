"""The GPU suite's plan, budget and report (`make test-gpu`), as a pytest plugin.

Each GPU test says what it needs beside it: ``@pytest.mark.gpu(seconds=40, gpus=2)`` (its
expected seconds on one H100-class GPU; the GPUs it needs, 1 unless said). Wherever pytest
collects such a test, it is skipped with the reason when this machine has no CUDA GPU or
fewer GPUs than it needs (CI: every GPU test skips, named). Under the runner
(``tests/gpu_suite.py``, which sets :data:`BUDGET_ENV` and :data:`REPORT_ENV`) the plugin also
prints the plan, starts a test only if its expected time fits in what is left of the budget
("not reached" otherwise), and rewrites the JSON report after every test (atomically: what a
run killed at its limit leaves is whole), with the figures each test recorded
(``record_property``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ddppipe.core import atomic

BUDGET_ENV = "DDPPIPE_GPU_BUDGET_S"  # the runner's budget in seconds (the plugin plans only then)
REPORT_ENV = "DDPPIPE_GPU_REPORT"  # where the JSON report goes
NOT_REACHED = "not reached"  # the start of a budget skip's reason


@dataclass(frozen=True)
class Part:
    """One GPU test as the plan sees it."""

    test: str  # its node id
    seconds: float  # expected, on one H100-class GPU
    gpus: int = 1
    skip: str | None = None  # why it cannot run on this machine, if it cannot


@dataclass
class Outcome:
    test: str
    expected_s: float
    outcome: str = "pending"  # passed, failed, skipped, not reached, pending
    duration_s: float = 0.0
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def part(test: str, marked: dict[str, Any], gpus_here: int, cuda: bool) -> Part:
    """The part of GPU test ``test`` whose marker says ``marked`` (seconds, gpus), on a machine
    with ``gpus_here`` CUDA GPUs (``cuda``: whether torch can use CUDA at all)."""
    seconds = float(marked.get("seconds", 0))
    if seconds <= 0:
        raise pytest.UsageError(f"{test}: say its expected time: gpu(seconds=N)")
    needs = int(marked.get("gpus", 1))
    skip = None
    if not cuda:
        skip = "needs a CUDA GPU"
    elif gpus_here < needs:
        skip = f"needs {needs} GPUs; this machine has {gpus_here}"
    return Part(test, seconds, needs, skip)


def plan_lines(parts: list[Part], budget_s: float) -> list[str]:
    """The plan as printed: each part's expected time, the total of those that can run."""
    lines = [f"GPU suite plan (budget {budget_s:.0f} s):"]
    for p in parts:
        skip = f"  [skip: {p.skip}]" if p.skip else ""
        lines.append(f"  {p.seconds:5.0f} s  {p.gpus} GPU(s)  {p.test}{skip}")
    total = sum(p.seconds for p in parts if not p.skip)
    fits = "fits" if total <= budget_s else "does NOT fit"
    lines.append(f"  {total:5.0f} s  expected here in all, which {fits} the budget")
    return lines


class Budget:
    """What is left of the budget, and whether a part may still start."""

    def __init__(self, seconds: float, started: float) -> None:
        self.seconds, self.started = seconds, started

    def left(self, now: float) -> float:
        return self.seconds - (now - self.started)

    def refusal(self, part: Part, now: float) -> str | None:
        """Why ``part`` must not start at ``now`` (its expected time does not fit), or None."""
        left = self.left(now)
        if part.seconds > left:
            left_s = max(left, 0)
            return f"{NOT_REACHED}: expects {part.seconds:.0f} s, {left_s:.0f} s of the budget left"
        return None


class Report:
    """The JSON report, written whole after every change."""

    def __init__(self, path: Path, budget_s: float, parts: list[Part], machine: dict) -> None:
        self.path, self.budget_s, self.machine = path, budget_s, machine
        self.started = time.time()
        self.outcomes = {
            p.test: Outcome(
                p.test, p.seconds, "skipped" if p.skip else "pending", 0.0, p.skip or ""
            )
            for p in parts
        }

    def record(self, test: str, **changes: Any) -> None:
        outcome = self.outcomes[test]
        for key, value in changes.items():
            if key == "figures":
                outcome.figures.update(value)
            else:
                setattr(outcome, key, value)
        self.write()

    def as_dict(self) -> dict[str, Any]:
        parts = [asdict(o) for o in self.outcomes.values()]
        counts: dict[str, int] = {}
        for o in parts:
            counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
        return {
            "machine": self.machine,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started)),
            "budget_s": self.budget_s,
            "elapsed_s": round(time.time() - self.started, 1),
            "counts": counts,
            "parts": parts,
        }

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.path, json.dumps(self.as_dict(), indent=1) + "\n")


def machine() -> dict[str, Any]:
    """The GPU stack the suite ran on (the provenance's own reading)."""
    from ddppipe.parallel import software

    stack = software.stack()
    keys = ("torch", "cuda", "cudnn", "nccl", "gpus", "driver", "cpu", "python")
    return {k: stack.get(k) for k in keys}


class Plugin:
    """The plan, budget and report of one run of the suite (:func:`pytest_configure`)."""

    def __init__(self, budget_s: float, report: Path) -> None:
        self.budget = Budget(budget_s, time.monotonic())
        self.report_path = report
        self.report: Report | None = None
        self.parts: dict[str, Part] = {}
        self.started: dict[str, float] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        parts = [self.parts[i.nodeid] for i in items if i.nodeid in self.parts]
        for line in plan_lines(parts, self.budget.seconds):
            print(line, flush=True)
        self.report = Report(self.report_path, self.budget.seconds, parts, machine())
        self.report.write()

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        part = self.parts.get(item.nodeid)
        if part is None or part.skip:
            return
        refusal = self.budget.refusal(part, time.monotonic())
        if refusal:
            assert self.report is not None
            self.report.record(item.nodeid, outcome=NOT_REACHED, reason=refusal)
            pytest.skip(refusal)
        self.started[item.nodeid] = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.report is None or report.nodeid not in self.report.outcomes:
            return
        current = self.report.outcomes[report.nodeid].outcome
        if current in (NOT_REACHED, "skipped"):
            return
        figures = dict(report.user_properties)
        if report.when == "call" or report.failed:
            outcome = "passed" if report.passed else "failed" if report.failed else "skipped"
            began = self.started.get(report.nodeid, time.monotonic())
            reason = "" if report.passed else str(report.longrepr)[-2000:]
            self.report.record(report.nodeid, outcome=outcome, figures=figures, reason=reason,
                               duration_s=round(time.monotonic() - began, 1))  # fmt: skip
        elif figures:
            self.report.record(report.nodeid, figures=figures)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(BUDGET_ENV) and os.environ.get(REPORT_ENV):
        plugin = Plugin(float(os.environ[BUDGET_ENV]), Path(os.environ[REPORT_ENV]))
        config.pluginmanager.register(plugin, "gpu_budget")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, each GPU test this machine cannot run (no CUDA, too few GPUs)."""
    import torch

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    plugin = config.pluginmanager.get_plugin("gpu_budget")
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        found = part(item.nodeid, marker.kwargs, count, cuda)
        if found.skip:
            item.add_marker(pytest.mark.skip(reason=found.skip))
        if plugin is not None:
            plugin.parts[item.nodeid] = found
