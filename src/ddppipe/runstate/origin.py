"""What a run's training started from: the git commit of its work tree (and whether it had
uncommitted changes) and the digest of its data's manifest, taken by each slot's launcher when
the slot starts (its attempt's ``origin``).

The provenance records the origin of the slot the final weights' training started in (the
first slot, or a later one that started again from step 0), not what the tree holds at export:
code committed during a long SLURM training is not the training's. A later slot whose origin
differs says so in the log and its attempt record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddppipe.core import system
from ddppipe.data import manifest


def taken(data: Path | None, cwd: Path | None = None) -> dict[str, Any]:
    """This slot's origin: ``{"git": {"commit", "dirty"}, "data": digest}`` (the data's
    manifest digest; None for a script run, or a folder without a manifest: its ranks refuse
    it)."""
    digest = None
    if data is not None:
        try:
            digest = manifest.read(data).get("digest")
        except manifest.ManifestError:
            digest = None
    return {"git": system.git_commit(cwd), "data": digest}


def started(history: list[dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The number and origin of the slot the run's training started in: the last slot that
    started at step 0 and recorded an origin, else the first that recorded one (None: no slot
    recorded one, a run trained before origins were recorded)."""
    recorded = [a for a in history if a.get("origin")]
    if not recorded:
        return None
    fresh = [a for a in recorded if a.get("start_step") == 0]
    first = fresh[-1] if fresh else recorded[0]
    return int(first["number"]), first["origin"]


def changes(before: dict[str, Any], now: dict[str, Any], since: int) -> list[str]:
    """What changed from slot ``since``'s origin ``before`` to this slot's ``now``, in words."""
    slot = "the first slot" if since == 1 else f"slot {since} (where the training started)"
    found = []
    was, is_ = before.get("git") or {}, now.get("git") or {}
    if was.get("commit") != is_.get("commit"):
        found.append(f"the code changed since {slot}: commit {_short(was.get('commit'))} -> "
                     f"{_short(is_.get('commit'))}")  # fmt: skip
    elif was.get("dirty") != is_.get("dirty"):
        state = (
            "has uncommitted changes now"
            if is_.get("dirty")
            else "is clean now (it had uncommitted changes)"
        )
        found.append(f"the code changed since {slot}: the tree of commit "
                     f"{_short(is_.get('commit'))} {state}")  # fmt: skip
    if before.get("data") != now.get("data"):
        found.append(f"the data changed since {slot}: manifest digest {before.get('data')} -> "
                     f"{now.get('data')} (its checkpoints are of other data: training starts "
                     "again)")  # fmt: skip
    return found


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "none (not in git)"
