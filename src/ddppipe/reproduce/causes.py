"""Why a reproduction came out different, as far as the records tell: a changed config value,
other code, another torch or device, a world size changed during the run, non-deterministic
GPU kernels, other packages."""

from __future__ import annotations

import itertools
from typing import Any

from ddppipe.reproduce.checks import Finding, as_decided, differing
from ddppipe.reproduce.source import Recorded
from ddppipe.settings.presets import AUTO


def config_values(run: Recorded) -> list[str]:
    """The train config the record says trained against the run's own config.yaml."""
    if run.config is None:
        return []
    recorded = run.provenance["train_config"]
    found = differing(as_decided(run.config.get("train", {}), recorded), recorded, "train.")
    return [f"a changed config value: {'; '.join(found)} (config.yaml vs record)"] if found else []


def world_sizes(attempts: list[dict[str, Any]]) -> list[str]:
    """A run whose slots trained at several world sizes: each change, at its first step."""
    changes = [f"{a['world_size']} -> {b['world_size']} ranks at step {b.get('start_step', '?')}"
               for a, b in itertools.pairwise(attempts)
               if a["world_size"] != b["world_size"]]  # fmt: skip
    if not changes:
        return []
    why = "each rank's share of the batch (its BatchNorm statistics) and the all-reduce's order"
    return [f"the run changed world size ({', '.join(changes)}): {why} changed there"]


def stack(run: dict[str, Any], again: dict[str, Any]) -> list[str]:
    """Another torch or another device (kind, model, CPU) between the two trainings."""
    a, b = run["training"], again["training"]
    found = []
    if a.get("torch") != b.get("torch"):
        found.append(f"another torch ({a.get('torch')} vs {b.get('torch')})")
    was = (a.get("device"), a.get("device_name"), run.get("software", {}).get("cpu"))
    now = (b.get("device"), b.get("device_name"), again.get("software", {}).get("cpu"))
    if was != now:
        found.append(f"another device ({', '.join(map(str, was))} vs {', '.join(map(str, now))})")
    return found


def precision(run: dict[str, Any], again: dict[str, Any]) -> list[str]:
    """Another precision: ``train.precision: auto`` decided otherwise by the devices that
    trained the reproduction (bf16 only where every rank computes it natively)."""
    a, b = (r["training"].get("precision") or {} for r in (run, again))
    if not a or not b or a["trained"] == b["trained"]:
        return []
    why = (": train.precision auto is bf16 only where every rank's device computes bfloat16 "
           "natively" if AUTO in (a["configured"], b["configured"]) else "")  # fmt: skip
    return [f"another precision ({a['trained']} vs {b['trained']}{why})"]


def kernels(run: dict[str, Any]) -> list[str]:
    """A GPU run without train.deterministic: its kernels may sum in any order."""
    if run["training"].get("device") != "cuda" or run["train_config"].get("deterministic"):
        return []
    return ["non-deterministic kernels (a GPU run without train.deterministic: true)"]


def of(run: Recorded, again: Recorded, findings: list[Finding]) -> list[str]:
    """Every cause the records show, the likeliest first."""
    named = {f.check: f for f in findings if f.status == "differs"}
    found = config_values(run)
    if "task" in named:
        found.append(f"the task file changed ({named['task'].text})")
    if "git" in named:
        found.append(f"other code ({named['git'].text})")
    found += precision(run.provenance, again.provenance)
    found += stack(run.provenance, again.provenance)
    found += world_sizes(run.attempts)
    found += kernels(run.provenance)
    if "packages" in named:
        found.append(f"other packages ({named['packages'].text})")
    if not found and run.provenance.get("config_hash") != again.provenance.get("config_hash"):
        found.append("another config hash (its task, task_args or data differ)")
    return found
