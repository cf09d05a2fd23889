"""Trials on disk under the names they had before ``+`` joined their keys, renamed once.

Until 2026-11 a trial's name joined its keys with ``,`` (``lr=0.01,batch_size=256``); the SLURM
plugin cuts a job's wildcards at commas, so such trials could not train on SLURM, and names
now join keys with ``+`` (:data:`ddppipe.settings.trial_names.SEPARATOR`). A comma was only
ever that separator (a value's own commas became ``_``), so the old name of ``a+b`` is
``a,b``, and :func:`rename` moves an old trial's folders (``results/``, ``logs/``,
``benchmarks/``) to its name of today, with its config's ``run`` and ``trial.name``, the
sweep's ``sweep.json`` and a model-based sweep's round files. Each file keeps its modification
time, so Snakemake sees the same finished outputs and trains nothing again; the Optuna journal
keeps the old names, read as today's
(:func:`ddppipe.settings.trial_names.current_name`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from ddppipe.core import atomic
from ddppipe.settings import config, layout, trial_names
from ddppipe.settings import sweep as sweeps


@contextlib.contextmanager
def _same_mtime(path: Path) -> Iterator[None]:
    """``path`` written in the block keeps the modification time it had before."""
    before = path.stat()
    yield
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _rename_config(path: Path, run: str, name: str) -> None:
    if not path.is_file():
        return
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict):
        return
    cfg["run"] = run
    if isinstance(cfg.get("trial"), dict):
        cfg["trial"]["name"] = name
    with _same_mtime(path):
        config.write(cfg, path)


def _rename_listed(path: Path) -> None:
    """The trials listed in ``path`` (a round file, sweep.json: ``{"trials": [{"name", ...}]}``)
    under their names of today."""
    doc = json.loads(path.read_text())
    listed = doc.get("trials", [])
    if not any(trial_names.LEGACY_SEPARATOR in t["name"] for t in listed):
        return
    for t in listed:
        t["name"] = trial_names.current_name(t["name"])
        if "run" in t:
            t["run"] = trial_names.current_name(t["run"])
    with _same_mtime(path):  # as rule sweep_trials and the rounds write them
        atomic.write_text(path, json.dumps(doc, indent=1) + "\n")


def rename(sweep_names: Iterable[str], results: Path = layout.RESULTS) -> list[str]:
    """Rename the old-named trials of the sweeps ``sweep_names`` under ``results`` (and their
    ``logs/`` and ``benchmarks/`` beside it); one line per trial renamed, or left because a
    trial of its name of today exists too."""
    base = Path(results).parent
    lines = []
    for sweep in sweep_names:
        folder = Path(results) / layout.SWEEPS / sweep
        for listed in [*sorted(folder.glob("rounds/*.json")), folder / "sweep.json"]:
            if listed.is_file():
                _rename_listed(listed)
        old_names = sorted(
            p.name for p in (folder.iterdir() if folder.is_dir() else ())
            if p.is_dir() and trial_names.LEGACY_SEPARATOR in p.name
        )  # fmt: skip
        for old in old_names:
            new = trial_names.current_name(old)
            old_run, new_run = sweeps.run_name(sweep, old), sweeps.run_name(sweep, new)
            if (folder / new).exists():
                lines.append(
                    f"{folder / old} left as it is: {folder / new} exists too (the trial under "
                    "its name of today); move one of them away"
                )
                continue
            for top in (Path(results), base / layout.LOGS, base / layout.BENCHMARKS):
                if (top / old_run).exists() and not (top / new_run).exists():
                    (top / old_run).rename(top / new_run)
            _rename_config(layout.RunLayout(new_run, Path(results)).config, new_run, new)
            lines.append(
                f"renamed trial {old_run} to {new_run} (trial names join their keys with "
                f"'{trial_names.SEPARATOR}': SLURM job steps cut names at commas); nothing retrains"
            )
    return lines
