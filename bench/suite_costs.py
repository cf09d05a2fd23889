"""The cost of a group of tests: CPU-seconds and wall time of a pytest run of them, and the
fresh interpreters each test started (those that imported torch: ~3.3 CPU-seconds each on the
2-core AVX2 machine), counted by a sitecustomize on the children's PYTHONPATH.

    python bench/suite_costs.py tests/test_fsdp.py                # a file
    python bench/suite_costs.py tests/test_sweep.py -m "not slow"  # any pytest selection

docs/tests.md (the cost of the groups) has its figures. A fork (a warm rank, a DataLoader
worker) is no fresh interpreter and is not counted; an interpreter that replaces its
environment's PYTHONPATH is not seen.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each interpreter appends a line at its start and one when it first imports torch (the
# ranks leave with os._exit: no line at exit).
SITECUSTOMIZE = """\
import json, os, sys


def _line(kind):
    with open(os.environ["DDPPIPE_TEST_COSTS"], "a") as f:
        f.write(json.dumps({"kind": kind, "pid": os.getpid(),
                            "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\\n")


class _FirstTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            _line("torch")
        return None


_line("start")
sys.meta_path.insert(0, _FirstTorch())
"""


def per_test(log: Path) -> dict[str, collections.Counter]:
    """Each test's fresh interpreters and those of them that imported torch."""
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in log.read_text().splitlines() if log.exists() else []:
        entry = json.loads(line)
        test = entry["test"].rsplit(" ", 1)[0] or "(pytest itself)"
        found[test][entry["kind"]] += 1
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ddppipe-test-costs-") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        log = Path(tmp) / "interpreters.jsonl"
        path = [tmp, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "DDPPIPE_TEST_COSTS": str(log)}
        before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *argv], cwd=REPO, env=env, check=False)  # fmt: skip
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        found = per_test(log)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print("\nfresh interpreters (of them importing torch), per test:")
    for test, counts in sorted(found.items(), key=lambda kv: -kv[1]["torch"]):
        print(f"{counts['start']:4d} ({counts['torch']:3d})  {test}")
    total = sum((c for c in found.values()), collections.Counter())
    print(f"\n{' '.join(argv)}: {cpu:.0f} CPU-s in {wall:.0f} s wall (load {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after); {total['start']} fresh interpreters, "
          f"{total['torch']} importing torch; pytest exit status {done.returncode}")  # fmt: skip
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
