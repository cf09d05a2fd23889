"""What ``ddppipe reproduce`` checks before it trains: the code, the data, the task, the
packages, the image and the device, each against the run's record.

A finding is ``ok``, ``differs`` (training goes on; the verdict may name it as the cause),
``unknown`` (nothing recorded to check against) or ``refuse`` (training would not be the
same run: nothing trains).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ddppipe.apptainer import identity
from ddppipe.core import hashing
from ddppipe.settings.presets import AUTO

Status = Literal["ok", "differs", "unknown", "refuse"]


@dataclass(frozen=True)
class Finding:
    """One check's outcome: what it checked, its status and a line saying what it found."""

    check: str  # git | data | task | packages | image | device | config
    status: Status
    text: str

    def line(self) -> str:
        return f"{self.check:9} {self.status:8} {self.text}"


def _git(*args: str, cwd: Path | None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def git(recorded: dict[str, Any], cwd: Path | None = None) -> Finding:
    """The recorded commit is in this repository, and this tree matches it (or what differs)."""
    commit = (recorded or {}).get("commit")
    if not commit:
        return Finding("git", "unknown", "the run recorded no git commit (not trained in git)")
    if _git("cat-file", "-e", f"{commit}^{{commit}}", cwd=cwd).returncode != 0:
        return Finding("git", "differs", f"commit {commit[:12]} is not in this repository "
                       f"(fetch it, then `git checkout {commit[:12]}`)")  # fmt: skip
    changed = _git("diff", "--name-only", commit, "--", cwd=cwd).stdout.split()
    dirty = " (its tree was dirty: uncommitted changes are not in the record)"
    note = dirty if recorded.get("dirty") else ""
    if not changed:
        status: Status = "differs" if note else "ok"
        return Finding("git", status, f"this tree is commit {commit[:12]}'s{note}")
    named = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return Finding("git", "differs", f"this tree differs from commit {commit[:12]} in {named}"
                   f"{note}")  # fmt: skip


def data(recorded: dict[str, str], data_dir: Path) -> Finding:
    """Every data file the run trained on, here with the SHA-256 it had (hashed now)."""
    changed, missing = [], []
    for rel, want in sorted(recorded.items()):
        path = data_dir / rel
        if not path.is_file():
            missing.append(rel)
        elif hashing.file_sha256(path) != want:
            changed.append(rel)
    if not changed and not missing:
        return Finding("data", "ok", f"{len(recorded)} files in {data_dir}, SHA-256 as recorded")
    what = [
        f"{data_dir / rel} changed since the run trained on it (SHA-256 {recorded[rel][:12]} "
        "recorded)"
        for rel in changed
    ]
    what += [f"{data_dir / rel} missing" for rel in missing]
    return Finding("data", "refuse", "; ".join(what) + ": nothing trained. Restore the run's "
                   "files (their SHA-256 are its provenance's data_sha256), or give their folder "
                   "with --data; then run ddppipe reproduce again")  # fmt: skip


def task(recorded: dict[str, Any] | None, current: dict[str, Any] | None) -> Finding:
    """The task file's SHA-256 now (the resolved config's task_source) against the record's."""
    want, have = (recorded or {}).get("sha256"), (current or {}).get("sha256")
    name = (recorded or {}).get("ref") or (recorded or {}).get("path") or "the task"
    if want is None:
        return Finding("task", "unknown", "the run recorded no task hash")
    if want == have:
        return Finding("task", "ok", f"{name}: SHA-256 {want[:12]} as recorded")
    return Finding("task", "differs", f"{name}: SHA-256 {str(have)[:12]} here, "
                   f"{want[:12]} recorded (the task file was edited)")  # fmt: skip


def packages(
    recorded: dict[str, str] | None, current: dict[str, str], where: str = "installed"
) -> Finding:
    """The distributions that will train (``current``: this environment's, or the image's:
    ``where`` says which) against the recorded ones (versions, added, removed)."""
    if not recorded:
        return Finding("packages", "unknown", "the run recorded no package list")
    keys = sorted(set(recorded) | set(current))
    diff = [f"{k} {recorded.get(k, 'absent')} -> {current.get(k, 'absent')}"
            for k in keys if recorded.get(k) != current.get(k)]  # fmt: skip
    if not diff:
        return Finding("packages", "ok", f"{len(recorded)} distributions as recorded"
                       f"{'' if where == 'installed' else f' ({where})'}")  # fmt: skip
    shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
    return Finding("packages", "differs", f"recorded -> {where}: {shown}")


def image_packages(
    recorded: dict[str, str] | None, container: dict[str, Any], found: Finding,
    labels: dict[str, str] | None, added: list[str] | None = None,
) -> Finding:  # fmt: skip
    """A container run's packages: those of its image and its task layer (the reproduction
    trains in them), never this machine's environment. ``found``: the image check's finding;
    ``labels``: the image's labels now (None: they could not be read), which record its
    packages when built by this ddppipe (:func:`ddppipe.apptainer.identity.packages`);
    ``added``: what the task's layer installs now (None: as recorded)."""
    path = container.get("path")
    layer = container.get(identity.LAYER) or {}
    if found.status == "ok":  # the same bytes: the packages the run trained with
        labels, added = container.get("labels") or labels, None
    added = layer.get("installed", []) if added is None else added
    in_image = identity.packages(labels or {}, added)
    where = f"the image {path}'s" + (" with its task layer" if layer else "")
    if in_image is not None:
        return packages(recorded, in_image, where)
    if found.status == "ok":
        return Finding("packages", "ok", f"{where}, SHA-256 as recorded: the "
                       "distributions the run trained with")  # fmt: skip
    return Finding("packages", "unknown", f"the image {path} records no package list in its "
                   "labels (built before ddppipe recorded them) and is not the run's: "
                   "compare `apptainer exec IMAGE pip list` with the provenance's "
                   "software.packages")  # fmt: skip


def _file(what: str, recorded: dict[str, Any], rebuild: str) -> str | None:
    """Why the file ``recorded`` names (``what``: the image, its task layer) is not the run's;
    None: it is here with the SHA-256 it had."""
    path = Path(recorded["path"])
    if not path.is_file():
        return f"{what} {path} (SHA-256 {recorded['sha256'][:12]}) is not here: {rebuild}"
    found = identity.sha256(path)
    if found != recorded["sha256"]:
        return (f"{what} {path}: SHA-256 {found[:12]}, the run's {recorded['sha256'][:12]} "
                "(rebuilt since)")  # fmt: skip
    return None


def image(recorded: dict[str, Any] | None) -> Finding:
    """The run's container image, and its task layer if it had one: here, with the SHA-256
    each had."""
    if not recorded:
        return Finding("image", "ok", "the run used no container image")
    layer = recorded.get(identity.LAYER)
    problems = [
        _file("the image", recorded, "build it from its recipe, or copy it"),
        layer and _file("its task layer", layer, "rule build_task_layer builds it again from "
                        f"container.requirements {' '.join(layer['requirements'])}, or copy it"),
    ]  # fmt: skip
    problems = [p for p in problems if p]
    if problems:
        return Finding("image", "differs", "; ".join(problems))
    text = f"{recorded['path']}: SHA-256 {recorded['sha256'][:12]} as recorded"
    if layer:
        text += f", its task layer {layer['path']}: SHA-256 {layer['sha256'][:12]} as recorded"
    return Finding("image", "ok", text)


def device(
    training: dict[str, Any], cpu: str | None, here: tuple[str, str, str],
    precision_here: str | None = None,
) -> Finding:  # fmt: skip
    """The device kind and model (and the CPU model) the run trained on against this machine's
    (``here``: kind, model, CPU model); and, for a run whose ``train.precision`` is ``auto``,
    what it trained in against what this machine decides (``precision_here``)."""
    kind, name = training.get("device"), training.get("device_name")
    was = f"{kind} ({name}, CPU {cpu})"
    now = f"{here[0]} ({here[1]}, CPU {here[2]})"
    decided = training.get("precision") or {}
    other = (decided.get("configured") == AUTO and precision_here is not None
             and precision_here != decided.get("trained"))  # fmt: skip
    note = (f"; train.precision auto trained in {decided.get('trained')} there and trains in "
            f"{precision_here} here (bf16 only where the device computes it natively)"
            if other else "")  # fmt: skip
    if (kind, name) == here[:2] and cpu in (None, here[2]) and not other:
        return Finding("device", "ok", f"{now}, as the run")
    return Finding("device", "differs", f"the run trained on {was}, this machine on {now}{note}")


def config(provenance_train: dict[str, Any], written: dict[str, Any] | None) -> Finding:
    """The provenance's train config against the run's own config.yaml (what its ranks read)."""
    if written is None:
        return Finding("config", "unknown", "no config.yaml beside the record: its train "
                       "config is trained as recorded")  # fmt: skip
    diff = differing(as_decided(written.get("train", {}), provenance_train), provenance_train,
                     "train.")  # fmt: skip
    if not diff:
        return Finding("config", "ok", "the record's train config is the run's config.yaml's")
    return Finding("config", "differs", "the record's train config is not the run's "
                   f"config.yaml's: {'; '.join(diff)} (config.yaml vs record; the record's "
                   "trains)")  # fmt: skip


def as_decided(written: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """A config.yaml's train section with its ``precision: auto`` as the ranks decided it in
    the record's train config (fp32 or bf16: what they trained in)."""
    if written.get("precision") == AUTO and "precision" in recorded:
        return {**written, "precision": recorded["precision"]}
    return written


def differing(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """``key a vs b`` for each key whose values differ (a key absent on one side: skipped)."""
    return [f"{prefix}{k} {a[k]!r} vs {b[k]!r}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
