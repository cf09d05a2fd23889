"""`make test-quick`, the inner loop of docs/tests.md: the tests without the `slow` marker,
and a test that needs the SLURM test cluster, Apptainer or the shared build of the local DAG
is never among them (tests/conftest.py marks it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.tiny import REPO

ALWAYS_SLOW_MARKERS = ("slurm", "apptainer")
ALWAYS_SLOW_FIXTURES = ("slurm_slot", "slurm_cluster", "slurm_accounting_cluster", "shared_build")


def make_dry_run(*args: str) -> list[str]:
    """The commands `make -n test-quick ARGS` would run (with the venv in place, only pytest)."""
    result = subprocess.run(["make", "-n", "-s", "test-quick", *args], cwd=REPO,
                            capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in result.stdout.splitlines() if "pytest" in line]


def test_make_test_quick_runs_the_tests_without_the_slow_marker_on_two_workers() -> None:
    (line,) = make_dry_run()
    assert line.endswith('/python -m pytest -n 2 -m "not slow" '), line


def test_make_test_quick_narrowed_to_files_runs_them_in_one_process() -> None:
    (line,) = make_dry_run("TESTS=tests/test_layout.py -k kind")
    assert line.endswith('/python -m pytest -n 0 -m "not slow" tests/test_layout.py -k kind'), line


def test_no_test_of_the_cluster_apptainer_or_the_shared_build_is_quick(
    request: pytest.FixtureRequest,
) -> None:
    """Every test collected in this session (under `-m "not slow"`: the quick ones only) that
    uses the cluster, Apptainer or the shared build carries the slow marker."""
    items = request.session.items
    assert request.node in items
    unmarked = [
        item.nodeid
        for item in items
        if not item.get_closest_marker("slow")
        and (
            any(item.get_closest_marker(name) for name in ALWAYS_SLOW_MARKERS)
            or set(getattr(item, "fixturenames", ())) & set(ALWAYS_SLOW_FIXTURES)
        )
    ]
    assert not unmarked, unmarked
