"""The software stack a run's provenance records (ddppipe.parallel.software): every installed
distribution, the OS and the CPU model, besides torch's CUDA, cuDNN and NCCL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddppipe.core import system
from ddppipe.parallel import software

XEON = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\n"
    "model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\nflags\t\t: avx2\n"
)
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize(("cpuinfo", "model"), [
    (XEON, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"),
    (GRAVITON2, "x86_64"),  # no model name: the machine type (this test's machine's)
    (None, "x86_64"),  # no /proc/cpuinfo
])  # fmt: skip
def test_the_cpu_model(cpuinfo: str | None, model: str, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(system.platform, "machine", lambda: "x86_64")
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    assert system.cpu_model(path) == model


def test_every_installed_distribution_by_name_and_version() -> None:
    import numpy
    import snakemake

    found = software.packages()
    assert list(found) == sorted(found)
    assert found["numpy"] == numpy.__version__ and found["snakemake"] == snakemake.__version__
    assert found["ddppipe"] == "0.1.0"
    stack = software.stack()
    assert stack["packages"] == found and stack["cpu"] == system.cpu_model()


def test_a_rank_raises_its_open_files_limit_to_the_hard_one() -> None:
    """Rank 0 of a large world holds a socket to every rank: its soft limit goes up to the
    hard one (a process that starts at 256 of 4,096)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096)); "
            "from ddppipe.core import system; print(system.raise_open_files_limit())")  # fmt: skip
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)  # fmt: skip
    assert found.stdout.strip() == "(4096, 4096)"
