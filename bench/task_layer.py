"""A changed ``container.requirements`` (one small package): the time until training can start.

After (ddppipe now): ``ddppipe build-task-layer`` installs the package over the image into a
SquashFS layer (rule build_task_layer), then the first process starts in the image with the
layer bound over it and imports the package and torch (what every rank does first).
Before (``--before``): the derived image ddppipe built until issue 53, ``apptainer build`` of
the base image plus the package (``Bootstrap: localimage``, pip in ``%post`` with the image's
packages as constraints: the recipe below, as ddppipe wrote it until then),
then the same first process in it.

    python bench/task_layer.py --image results/images/ddppipe.sif [--package humanize==4.17.0]
        [--before] [--repeat 3] [--local]

The package comes from PyPI (or the host's PIP_INDEX_URL / PIP_FIND_LINKS), downloaded by
every build (an empty pip cache each, as a first build has); with ``--local`` from the tests'
own packages instead (tests/local_wheel.py), no index: ``blobfmt==1.1`` a pure-Python wheel,
``torchver==1.0`` a source distribution whose build imports torch (built in the image against
its torch), ``cppext==1.0`` a C++ extension over torch's headers (refused where the image has
no compiler: the seconds until the refusal).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddppipe.apptainer import running
from ddppipe.apptainer.layer import build_layer
from ddppipe.apptainer.tool import ContainerError

BEFORE = """\
Bootstrap: localimage
From: {base}

%files
    /etc/ssl/certs/ca-certificates.crt /opt/ddppipe-build/ca-certificates.crt

%post
    set -eu
    export PIP_CONFIG_FILE=/dev/null PIP_CERT=/opt/ddppipe-build/ca-certificates.crt
    export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
    cd /opt/ddppipe-build
    /opt/venv/bin/pip list --format=freeze > base.txt
    /opt/venv/bin/pip install --constraint base.txt {package}
    /opt/venv/bin/pip check
    cd / && rm -rf /opt/ddppipe-build /root/.cache
"""


def module_of(package: str) -> str:
    """The import name of ``package`` (``name==version``), as its name spells it."""
    return package.split("==")[0].replace("-", "_").lower()


def first_process(image: Path, layer: Path | None, module: str) -> float:
    """Seconds for a process in ``image`` (``layer`` over it) importing ``module`` and torch."""
    binds = []
    if layer is not None:
        site = running.TASK_SITE
        binds = ["--bind", f"{layer}:{site}:ro,image-src=/", "--env", f"PYTHONPATH={site}",
                 "--env", "PYTHONNOUSERSITE=1"]  # fmt: skip
    start = time.monotonic()
    subprocess.run(["apptainer", "exec", *binds, str(image), "python", "-c",
                    f"import {module}, torch"], check=True)  # fmt: skip
    return time.monotonic() - start


def after(base: Path, package: str, work: Path) -> tuple[float, float, int]:
    """The layer: its build's seconds, the first process's, its size in bytes."""
    os.environ["PIP_CACHE_DIR"] = str(work / "pip-cache")  # empty: the package downloaded
    layer = work / "task.layer.sqfs"
    start = time.monotonic()
    try:
        info = build_layer(base, [package], layer, work / "layer.log")
    except ContainerError as e:
        print(f"refused after {time.monotonic() - start:.1f} s: {str(e).splitlines()[1]}")
        return time.monotonic() - start, float("nan"), 0
    built = time.monotonic() - start
    return built, first_process(base, layer, module_of(package)), info["size_bytes"]


def before(base: Path, package: str, work: Path) -> tuple[float, float, int]:
    """The derived image: its build's seconds, the first process's, its size in bytes."""
    recipe, image = work / "derived.def", work / "derived.sif"
    recipe.write_text(BEFORE.format(base=base.resolve(), package=package))
    start = time.monotonic()
    with open(work / "derived.log", "w") as log:
        subprocess.run(["apptainer", "build", "--fakeroot", "--force", "--mksquashfs-args",
                        "-comp zstd -Xcompression-level 3", str(image), str(recipe)],
                       stdout=log, stderr=subprocess.STDOUT, check=True)  # fmt: skip
    built = time.monotonic() - start
    return built, first_process(image, None, module_of(package)), image.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, required=True, help="the base image (built)")
    parser.add_argument("--package", default="humanize==4.17.0")
    parser.add_argument("--before", action="store_true", help="also the derived image, once")
    parser.add_argument("--repeat", type=int, default=3, help="layers to build")
    parser.add_argument("--local", action="store_true", help="the tests' packages, no index")
    args = parser.parse_args()
    if args.local:  # (in /tmp: visible in the image)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.local_wheel import blobfmt_wheels, cppext_sdist, torchver_sdist

        folder = Path(tempfile.mkdtemp(prefix="ddppipe-bench-packages-"))
        atexit.register(shutil.rmtree, folder, True)
        blobfmt_wheels(folder, "1.1")
        torchver_sdist(folder)
        cppext_sdist(folder)
        os.environ.update(PIP_FIND_LINKS=str(folder), PIP_NO_INDEX="1")
    size = args.image.stat().st_size / 2**30
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, "
          f"base {args.image} ({size:.1f} GiB), {args.package}")  # fmt: skip
    print(f"{'way':<15} {'build s':>8} {'1st process s':>14} {'ready s':>8} {'size':>10}")
    runs = [("layer", after)] * args.repeat + ([("derived image", before)] if args.before else [])
    for name, how in runs:
        with tempfile.TemporaryDirectory(dir=args.image.parent, prefix=".bench-") as tmp:
            built, first, size = how(args.image, args.package, Path(tmp))
        print(f"{name:<15} {built:8.1f} {first:14.1f} {built + first:8.1f} "
              f"{size / 2**20:8.2f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
