"""A task's packages as a layer: ``container.requirements`` installed once inside the base
image into a folder, squashed into a small SquashFS file bound over the image on every node.

The image's own pip resolves the requirements with the image's installed distributions as
constraints of every pip call and every build (nothing it has is upgraded or shadowed, and a
source package's build uses the image's torch: no build isolation) and installs only what the
image lacks (``pip install --target``, its byte-code compiled as found where it is bound); a
source package the image cannot build is refused before its build
(:mod:`~ddppipe.apptainer.layer_checks`). The folder is packed with ``mksquashfs``
(deterministic: owner root, every time 0, modes 0644/0755, byte-code checked by hash), the
packed file checked in the image as the ranks bind it (every module imported, namespaces
whole) and renamed into place: a failed build leaves nothing. Training binds it read-only at
:data:`~ddppipe.apptainer.running.TASK_SITE` (:func:`ddppipe.apptainer.running.exec_prefix`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ddppipe.apptainer import layer_checks
from ddppipe.apptainer.binds import bind_args
from ddppipe.apptainer.identity import info_path, sha256
from ddppipe.apptainer.requirements import pinned
from ddppipe.apptainer.running import TASK_SITE, layer_bound
from ddppipe.apptainer.tool import APPTAINER, ContainerError

# The host's pip settings that reach the image's pip (a mirror, a local folder of wheels, its
# cache, a proxy); nothing else of the host's environment or pip configuration files does.
PASSED = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX",
          "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR",
          "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
          "no_proxy")  # fmt: skip
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
CONFLICT = 3  # the script's exit status when the requirements conflict with the image
SQUASH_TIMEOUT_S = 600  # mksquashfs of a layer's folder (seconds)

# Run by the image's shell in the build's folder ($1): what the image has (base.txt), a
# constraint of every pip call and of every build (PIP_CONSTRAINT reaches build environments,
# --constraint does not); what the requirements add to it (pip's dry-run report), wheels and
# source distributions; the source distributions read before any is built (layer_checks.py:
# what their build needs and the image lacks refuses them), then built without isolation, in
# the image's own environment (an extension compiles against the image's torch, never a newer
# one from the index) and never from pip's cache of wheels (one built against another image's
# torch); only that installed into site/ (--no-deps: the resolution is done; the built ones
# found by name, as pip records an index's and not a file's path), its byte-code
# compiled as found where it is bound ($2: pip's would name its temporary folder, a build's
# own).
SCRIPT = r"""set -eu
cd "$1"
python -m pip list --format=freeze > base.txt
export PIP_CONSTRAINT="$PWD/base.txt"
if ! python -m pip install --dry-run --quiet --no-build-isolation --use-pep517 \
        --report report.json --requirement requirements.txt; then
    echo "ddppipe: container.requirements cannot be installed over the image's own packages" \
        "(base.txt: kept at these versions)" >&2
    exit 3
fi
python - <<'EOF'
import json
import os
import shutil
from urllib.parse import unquote, urlparse

os.mkdir("sdists")
with open("pins.txt", "w") as pins, open("sources.txt", "w") as sources:
    for item in json.load(open("report.json"))["install"]:
        pin = f"{item['metadata']['name']}=={item['metadata']['version']}\n"
        pins.write(pin)
        url = urlparse(item["download_info"]["url"])
        if url.path.endswith(".whl"):
            continue
        if url.scheme == "file":  # (a local folder of packages: read where it is)
            shutil.copy(unquote(url.path), "sdists")
        else:
            sources.write(pin)
EOF
if [ -s sources.txt ]; then
    python -m pip download --quiet --no-deps --no-build-isolation --use-pep517 \
        --no-binary :all: --dest sdists --requirement sources.txt
fi
mkdir site built
if [ -n "$(ls sdists)" ]; then
    python layer_checks.py sources sdists
    python -m pip wheel --quiet --no-deps --no-build-isolation --use-pep517 --no-cache-dir \
        --wheel-dir built sdists/*
fi
if [ -s pins.txt ]; then
    python -m pip install --quiet --no-deps --no-compile --target site --find-links built \
        --only-binary :all: --requirement pins.txt
    python -m compileall -q --invalidation-mode checked-hash -s site -p "$2" site ||
        echo "ddppipe: files above that do not compile are left without byte-code (as pip does)"
fi
"""
# Run by the image's shell with the packed layer bound at $2, first on Python's path: every
# top-level module it installs imported, the namespaces it shares with the image whole
# (layer_checks.py, from the build's folder $1), then pip check of the image with it.
CHECK = r"""set -eu
python "$1/layer_checks.py" imports "$2"
cd / && python -m pip check
"""


def _ca_bundle() -> Path | None:
    """The host's CA bundle (``PIP_CERT``, else the system's): the image's pip trusts it."""
    for found in (os.environ.get("PIP_CERT"), *CA_BUNDLES):
        if found and Path(found).is_file():
            return Path(found)
    return None


def _environment(work: Path) -> list[str]:
    """``--env`` options of the image's pip: no configuration file, the host's CA bundle, the
    passed settings (:data:`PASSED`), byte-code checked by hash (``SOURCE_DATE_EPOCH``)."""
    env = {"PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_ROOT_USER_ACTION": "ignore", "PYTHONNOUSERSITE": "1",
           "SOURCE_DATE_EPOCH": "0"}  # fmt: skip
    if (work / "ca.crt").is_file():
        env["PIP_CERT"] = str(work / "ca.crt")
    env.update({k: os.environ[k] for k in PASSED if os.environ.get(k)})
    return [arg for k, v in env.items() for arg in ("--env", f"{k}={v}")]


def installed(site: Path) -> list[str]:
    """The distributions in ``site`` as ``name==version``, by lower-case name (as the
    provenance's ``software.packages`` names them), sorted."""
    found = []
    for meta in site.glob("*.dist-info/METADATA"):
        fields = dict(re.findall(r"^(Name|Version): (.+)$", meta.read_text(errors="replace"), re.M))
        found.append(f"{fields['Name'].strip().lower()}=={fields['Version'].strip()}")
    return sorted(found)


def _tail(log: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def _run(cmd: list[str], name: str, log: Path, timeout_s: float) -> int:
    """Run ``cmd`` (``apptainer exec ... IMAGE /bin/sh -c`` :data:`SCRIPT` or :data:`CHECK`,
    its ``name``, and 3 arguments), its output to ``log``; its exit status."""
    with open(log, "a") as out:
        out.write(f"# {' '.join(cmd[:-6])} /bin/sh -c {name} {' '.join(cmd[-3:])}\n")
        out.flush()
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise ContainerError(
                f"the layer's {name} in {cmd[-7]} timed out after {timeout_s:.0f} s; log: {log}"
            ) from e


def _refused(work: Path, log: Path, doing: str, instead: str) -> ContainerError:
    """The error of a refusal by layer_checks.py: each reason (refused.txt), what to do."""
    reasons = (work / layer_checks.REFUSAL).read_text().splitlines()
    return ContainerError(
        f"container.requirements: {doing}:\n"
        + "".join(f"  {r}\n" for r in reasons)
        + instead
        + f"\nLog: {log}"
    )


def _install(base: Path, work: Path, log: Path, timeout_s: float) -> None:
    """Run :data:`SCRIPT` in ``base`` on ``work`` (its requirements.txt), the output to ``log``."""
    cmd = [APPTAINER, "exec", "--cleanenv", *bind_args(work, work), *_environment(work),
           str(base), "/bin/sh", "-c", SCRIPT, "layer", str(work), TASK_SITE]  # fmt: skip
    rc = _run(cmd, "SCRIPT", log, timeout_s)
    if rc == CONFLICT:
        raise ContainerError(
            f"container.requirements cannot be installed over the image {base}'s own packages "
            "(kept at their versions: torch, CUDA and NCCL stay the image's): choose versions "
            "compatible with them, or one that exists on an index this machine reaches "
            "(PIP_INDEX_URL, PIP_FIND_LINKS, the proxy variables: docs/container.md). "
            f"Log: {log}\n--- last lines ---\n"
            f"{_tail(log)}"
        )
    if rc == layer_checks.REFUSED:
        raise _refused(
            work, log, f"not built: a source distribution pip would build in {base} cannot be "
            "built there (nothing was compiled)",
            "Pin a version that has a wheel for the image's Python and platform (`pip download "
            "--only-binary :all: NAME==VERSION` tells), or build your own image with what is "
            "missing (container.recipe: a copy of containers/ddppipe.def with e.g. `apt-get "
            "install -y g++ python3-dev` in %post, or a CUDA devel base for nvcc), where the "
            "package can be installed in %post too.",
        )  # fmt: skip
    if rc != 0:
        raise ContainerError(
            f"installing container.requirements in {base} failed (exit {rc}); log: {log}\n"
            f"--- last lines ---\n{_tail(log)}"
        )


def _check(base: Path, work: Path, packed: Path, log: Path, timeout_s: float) -> None:
    """Run :data:`CHECK` in ``base`` with the layer ``packed`` bound as training binds it."""
    cmd = [APPTAINER, "exec", "--cleanenv", *bind_args(work, work), *layer_bound(packed),
           str(base), "/bin/sh", "-c", CHECK, "check", str(work), TASK_SITE]  # fmt: skip
    rc = _run(cmd, "CHECK", log, timeout_s)
    if rc == layer_checks.REFUSED:
        raise _refused(
            work, log, f"not used: the layer cannot be imported as every rank would, in {base} "
            f"with the layer at {TASK_SITE} first on Python's path",
            "A package that is split with the image, or needs what the image lacks (a system "
            "library, a newer package the image pins), belongs in your own image "
            "(container.recipe): install it there in %post.",
        )  # fmt: skip
    if rc != 0:
        raise ContainerError(
            f"container.requirements: the layer breaks the image's packages (pip check, exit "
            f"{rc}); log: {log}\n--- last lines ---\n{_tail(log)}"
        )


def _squash(site: Path, packed: Path, log: Path) -> None:
    """``mksquashfs`` ``site`` into ``packed`` (the shared, deterministic arguments: every
    file readable, owner root, whatever the umask it was written under); removed if it fails."""
    from ddppipe.data.squashfs import MKSQUASHFS, MKSQUASHFS_ARGS, version_problem

    tool = shutil.which(MKSQUASHFS)
    if tool is None:
        raise ContainerError(
            "mksquashfs is not on PATH: install squashfs-tools (apt-get install squashfs-tools, "
            "dnf install squashfs-tools): container.requirements are packed with it"
        )
    printed = subprocess.run([tool, "-version"], capture_output=True, text=True, check=False)
    problem = version_problem(printed.stdout + printed.stderr, "container.requirements",
                              "install the packages in the image's recipe instead")  # fmt: skip
    if problem:
        raise ContainerError(problem)
    try:
        with open(log, "a") as out:
            subprocess.run([tool, str(site), str(packed), *MKSQUASHFS_ARGS], stdout=out,
                           stderr=subprocess.STDOUT, check=True,
                           timeout=SQUASH_TIMEOUT_S)  # fmt: skip
    except subprocess.CalledProcessError as e:
        packed.unlink(missing_ok=True)
        raise ContainerError(f"mksquashfs {site} failed (exit {e.returncode}); log: {log}") from e
    except subprocess.TimeoutExpired as e:
        packed.unlink(missing_ok=True)
        raise ContainerError(
            f"mksquashfs {site} did not end within {SQUASH_TIMEOUT_S:g} s (a slow or full "
            f"filesystem at {packed.parent}?); log: {log}"
        ) from e


def build_layer(
    base: str | Path, reqs: list[str], layer: str | Path, log: str | Path, timeout_s: float = 1800
) -> dict[str, Any]:
    """Install the pinned ``reqs`` over the image ``base`` into the SquashFS file ``layer``,
    checked in the image and renamed into place, atomically; its info: path, SHA-256, size,
    the requirements, what it installed, what was built from source (against which torch), and
    the base image's path and SHA-256 (from its info JSON when there is one)."""
    reqs = pinned(reqs)
    if not reqs:
        raise ContainerError("no requirements to add: train in the base image itself")
    base, layer, log = Path(base), Path(layer), Path(log)
    if not base.is_file():
        raise ContainerError(f"base image {base} not found: build it first (rule build_image)")
    if shutil.which(APPTAINER) is None:
        raise ContainerError("apptainer is not on PATH: install it, or set container.mode: none")
    found = info_path(base)
    base_sha = json.loads(found.read_text())["sha256"] if found.is_file() else sha256(base)
    layer.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# the layer {layer}: {' '.join(reqs)} over {base}\n")
    work = Path(tempfile.mkdtemp(prefix=f".{layer.name}.", suffix=".build", dir=layer.parent))
    packed = work / "layer.sqfs"  # renamed into place once checked
    try:
        (work / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
        shutil.copyfile(layer_checks.__file__, work / "layer_checks.py")
        ca = _ca_bundle()
        if ca is not None:
            shutil.copyfile(ca, work / "ca.crt")
        _install(base.resolve(), work.resolve(), log, timeout_s)
        added = installed(work / "site")
        sources = work / "sources.json"
        built = json.loads(sources.read_text()) if sources.is_file() else []
        _squash(work / "site", packed, log)
        _check(base.resolve(), work.resolve(), packed.resolve(), log, timeout_s)
        os.chmod(packed, 0o444)
        os.replace(packed, layer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "path": str(layer),
        "sha256": sha256(layer),
        "size_bytes": layer.stat().st_size,
        "requirements": reqs,
        "installed": added,
        "from_source": built,
        "base": {"path": str(base), "sha256": base_sha},
    }
