"""How long a finished sweep's table takes to write: 1,000 trials (#27: at most 5 s).

Builds a simulated finished grid sweep in a scratch folder, each trial's run folder holding
the files a real trial leaves (its resolved config, per-epoch metrics, attempt history, final
evaluation, export; formats copied from a real digits sweep), then times ``ddppipe
sweep-table``'s work (reading every trial, ranking, writing trials.csv and best.json) and,
apart, the TensorBoard HParams files written with it. No torch.

    python bench/sweep_table.py                 # 1,000 trials (a 40 x 25 grid), 3 epochs each
    python bench/sweep_table.py --trials 200
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ddppipe.settings import config, layout, sweep

DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
START = 1_795_000_000.0  # the simulated trials' first slot's start (Unix time)
EPOCH_S = 10.0  # each simulated epoch ends this many seconds after the one before
TASK_SOURCE = {"ref": "ddppipe.tasks.digits", "name": "digits", "path": "digits.py",
               "sha256": "f" * 64, "version": "0.1.0"}  # fmt: skip


def base_config(sweep_section: Mapping[str, Any]) -> dict[str, Any]:
    """A digits config with ``sweep_section``, 2 CPUs a process, checked and resolved."""
    return config.resolve(config.validate({
        "run": "digits", "task": "ddppipe.tasks.digits",
        "train": {"preset": "fast", "epochs": 3, "batch_size": 64},
        "launch": {"nproc_per_node": 1, "cpus_per_proc": 2}, "sweep": dict(sweep_section),
    }), gpus=False)  # fmt: skip


def write_config(run: layout.RunLayout, resolved: dict[str, Any], found: sweep.Sweep,
                 trial: sweep.Trial) -> None:  # fmt: skip
    """The trial's resolved config as write_config leaves it (``resolved``: another trial's,
    which differs in the trial's values alone: resolving 1,000 configs takes minutes)."""
    out = sweep.apply(resolved, found, trial)
    out["scaling"], out["sweep"] = resolved["scaling"], resolved["sweep"]
    out["task_source"] = dict(TASK_SOURCE)
    run.config.parent.mkdir(parents=True, exist_ok=True)
    run.config.write_text(yaml.dump(out, Dumper=DUMPER, sort_keys=False))


def resolved_trial(cfg: dict[str, Any], found: sweep.Sweep, trial: sweep.Trial) -> dict[str, Any]:
    """The config write_config resolves for ``trial`` (every key filled, as on the machine)."""
    return config.resolve(sweep.apply(cfg, found, trial), gpus=False)


def epochs(accuracies: list[float]) -> list[dict[str, Any]]:
    """metrics.jsonl's records: epoch k ends at START + k * EPOCH_S with these accuracies."""
    return [
        {"epoch": k, "train_loss": 1.0 / k, "test_loss": 1.0 - a, "test_accuracy": a,
         "images_per_s": 1000.0 * k, "epoch_seconds": EPOCH_S, "train_seconds": 8.0,
         "lr": 0.01, "world_size": 1, "time": START + k * EPOCH_S}
        for k, a in enumerate(accuracies, 1)
    ]  # fmt: skip


def attempt(outcome: str, n_epochs: int, **extra: Any) -> dict[str, Any]:
    """One SLURM slot (job 4242, queued 30 s) that trained ``n_epochs`` epochs and ended
    ``outcome``; its figures (efficiency) only when it ended by itself."""
    record: dict[str, Any] = {
        "number": 1, "job": "4242", "restarts": 0, "nodes": ["c1"], "start": START,
        "end": START + n_epochs * EPOCH_S + 6.0, "outcome": outcome, "exit_status": 0,
        "resumed_from": None, "start_step": 0, "end_step": 10 * n_epochs, "checkpoint": None,
        "checkpoint_seconds": 0.01, "stop_seconds": None, "queue_s": 30.0, "peak": None,
        "submitted": START - 30.0, "detail": "", "failure": None,
        "efficiency": {"startup_s": 3.0, "data_s": 0.1, "train_s": 8.0 * n_epochs,
                       "evaluate_s": 0.5, "checkpoint_s": 0.1, "cpu_s": 30.0, "steps": 10,
                       "images_per_s": 1000.0, "memory_peak_mb": 500.0},
    }  # fmt: skip
    record.update(extra)
    return record


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def completed(run: layout.RunLayout, accuracies: list[float], pruned_at: int | None = None) -> None:
    """A trial that completed (or, with ``pruned_at``, was pruned at that epoch)."""
    history = epochs(accuracies)
    write_jsonl(run.train.metrics, history)
    write_json(run.train.attempts, [attempt("completed", len(history))])
    evaluation = {"config_hash": "e1446df87e2df8ed", "epochs": len(history),
                  "precision": "bfloat16", "test_accuracy": accuracies[-1], "test_count": 450,
                  "test_loss": 1.0 - accuracies[-1]}  # fmt: skip
    if pruned_at is not None:
        evaluation["pruned_at_epoch"] = pruned_at
    write_json(run.train.evaluation, evaluation)
    write_json(run.eval.metrics, evaluation)
    for path in (run.export.weights, run.export.provenance):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")


def crashed(run: layout.RunLayout, accuracies: list[float], cause: str) -> None:
    """A trial whose slot crashed after ``len(accuracies)`` epochs: its state folder only."""
    live = run.state
    write_jsonl(live / "metrics.jsonl", epochs(accuracies))
    slot = attempt("crashed (exit 1)", len(accuracies), exit_status=1, detail=cause,
                   efficiency=None)  # fmt: skip
    write_json(live / "attempts.json", [slot])


def simulated(root: Path, n: int) -> Path:
    """A finished grid sweep of ``n`` trials (``lr`` x ``width``) under ``root/results``, all
    completed with 3 epochs; its sweep.json."""
    widths = [8 * (i + 1) for i in range(25)]
    lrs = [round(0.001 * (i + 1), 4) for i in range(max(1, n // len(widths)))]
    section = {"name": "big", "parameters": {"train.lr": lrs, "task_args.width": widths}}
    cfg = base_config(section)
    found = sweep.from_config(cfg)
    assert found is not None
    results = root / "results"
    chosen = sweep.trials(found)[:n]
    resolved = resolved_trial(cfg, found, chosen[0])
    for i, trial in enumerate(chosen):
        run = layout.RunLayout(trial.run, results)
        write_config(run, resolved, found, trial)
        completed(run, [0.5, 0.8, 0.9 + (i % 97) / 1000])
    from ddppipe.sweeps import trials

    doc = trials.document(found)
    doc["trials"] = doc["trials"][:n]
    path = found.layout.trials_csv.parent
    target = results / path.relative_to(layout.RESULTS) / "sweep.json"
    write_json(target, doc)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    args = parser.parse_args()
    from ddppipe.sweeps import hparams, table, trials

    with tempfile.TemporaryDirectory() as tmp:
        sweep_json = simulated(Path(tmp), args.trials)
        start = time.perf_counter()
        found = trials.load(sweep_json)
        table.write(found, found.layout.trials_csv, found.layout.best)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        written = hparams.write(found)
        hparams_s = time.perf_counter() - start
        start = time.perf_counter()
        again = hparams.write(trials.load(sweep_json))
        again_s = time.perf_counter() - start
        rows = len(found.layout.trials_csv.read_text().splitlines()) - 1
    print(
        f"machine: {platform.node()} ({platform.processor() or platform.machine()}), "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(
        f"sweep table: {rows} trials read, ranked and written in {seconds:.2f} s (#27: at most 5 s)"
    )
    print(
        f"TensorBoard HParams: {written} event files written in {hparams_s:.2f} s; "
        f"unchanged, {again} rewritten in {again_s:.2f} s (with the table read again)"
    )
    print(f"ddppipe sweep-table's work in all (table, best trial, HParams): "
          f"{seconds + hparams_s:.2f} s")  # fmt: skip
    print("torch imported:", "torch" in sys.modules)
    return 0 if seconds <= 5.0 and "torch" not in sys.modules else 1


if __name__ == "__main__":
    sys.exit(main())
