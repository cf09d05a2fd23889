"""`make test-gpu`: every GPU test in one pytest session, within a budget, with one report.

    python -m tests.gpu_suite [--budget 480] [--out results/gpu-suite]

Without a CUDA GPU it says so in one line and exits 2, running nothing. Otherwise it runs the
tests marked ``gpu`` (``tests/test_gpu*.py``) in one pytest session with the plan, budget and
report of :mod:`tests.gpu_plan`: the plan first (each test's expected time on one H100-class
GPU, those that need more GPUs than this machine has skipped with the reason), then each test
only if its expected time fits in what is left of the budget. The budget is enforced: past it
(and a grace for the test under way) the session is stopped, and the report says what ran,
what failed, what was skipped and what was not reached. ``OUT/report.json`` holds each test's
outcome, time and figures (images/s, the all-reduce's bandwidth, the GEMM peak, ...) and the GPU
stack; ``OUT/log.txt`` the session's output. Exit status: pytest's, 124 when stopped at the
budget.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ddppipe.core import atomic
from tests import gpu_plan

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0  # 8 minutes on one GPU (issue #54)
GRACE_S = 60.0  # the test under way when the budget ends may finish within this
NO_GPU = 2  # the exit status without a CUDA GPU, after its one line:
NO_GPU_LINE = "make test-gpu: no CUDA GPU here (torch sees none): nothing run"


def cuda_gpus() -> int:
    """How many CUDA GPUs this process sees (0: none, or no CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def command(out: Path, extra: list[str]) -> list[str]:
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_gpu*.py"))
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rsfE",
            "-v", f"--junitxml={out / 'junit.xml'}", *files, *extra]  # fmt: skip


def run(budget_s: float, out: Path, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, gpu_plan.BUDGET_ENV: str(budget_s), gpu_plan.REPORT_ENV: str(report),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(
            command(out, extra), cwd=REPO, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None

        def copy() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                sys.stdout.write(line)
                log.write(line)
            log.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=budget_s + GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
        reader.join(timeout=10)
    summarize(report, code)
    return code


def summarize(report: Path, code: int) -> None:
    """The report's counts and each test that did not pass, in a few lines."""
    if not report.exists():
        print(f"gpu suite: no report ({report}): pytest stopped before collecting (exit {code})")
        return
    data = json.loads(report.read_text())
    if code == 124:
        for part in data["parts"]:
            if part["outcome"] == "pending":
                part["outcome"], part["reason"] = gpu_plan.NOT_REACHED, "stopped at the budget"
        atomic.write_text(report, json.dumps(data, indent=1) + "\n")
    counts = {}
    for part in data["parts"]:
        counts[part["outcome"]] = counts.get(part["outcome"], 0) + 1
    print(f"gpu suite: {counts} in {data['elapsed_s']:.0f} s of a {data['budget_s']:.0f}-s "
          f"budget on {data['machine'].get('gpus')}; report {report}")  # fmt: skip
    for part in data["parts"]:
        if part["outcome"] not in ("passed",):
            print(f"  {part['outcome']}: {part['test']}: {part['reason'].splitlines()[-1:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "gpu-suite")
    args, extra = parser.parse_known_args(argv)
    gpus = cuda_gpus()
    if not gpus:
        print(NO_GPU_LINE, file=sys.stderr)
        return NO_GPU
    return run(args.budget, args.out.resolve(), extra)


if __name__ == "__main__":
    sys.exit(main())
