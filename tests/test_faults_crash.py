"""A user's model that goes wrong on one rank, through the local DAG (2 ranks, tiny MNIST): a
crash named by its first failing rank, exception and line of the user's file; a NaN loss that
stops the run at its step, with nothing exported."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from ddppipe.launching import resolve
from ddppipe.reports import summary, summary_html
from tests.conftest import run_cli
from tests.tiny import TinyData, make_tiny, tiny_config
from tests.workflow_helpers import snakemake

# A task file as a user writes it: MNIST's data (ddppipe's own task) and a model of theirs.
# Its forward raises on rank 1 at its 5th training batch.
CRASHING_TASK = '''\
"""MNIST with my linear model."""

import os

import torch
from torch import nn

from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, prepare  # noqa: F401


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)
        self.batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.batches += 1
            if os.environ["RANK"] == "1" and self.batches == 5:
                raise RuntimeError(f"shape trouble in batch {self.batches}")
        return self.fc(x.flatten(1))


def model(args: dict) -> nn.Module:
    return Linear()
'''

# Its loss turns NaN on rank 1 from its 10th training batch on (epoch 2: 8 steps an epoch).
NAN_TASK = '''\
"""MNIST with my linear model and a loss that blows up."""

import os

import torch
import torch.nn.functional as F
from torch import nn

from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, prepare  # noqa: F401

batches = 0


def model(args: dict) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    global batches
    value = F.cross_entropy(output, target)
    if torch.is_grad_enabled():
        batches += 1
        if os.environ["RANK"] == "1" and batches >= 10:
            return value * float("nan")
    return value
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    return make_tiny(tmp_path_factory.mktemp("tiny"))  # 256 samples: 8 steps of 32 an epoch


def user_run(workdir: Path, tiny: TinyData, name: str, source: str) -> tuple[dict, Path]:
    """``workdir`` with ``tasks/<name>.py``; the config of a 2-epoch run of it."""
    task = workdir / "tasks" / f"{name}.py"
    task.parent.mkdir(parents=True, exist_ok=True)
    task.write_text(source)
    cfg = tiny_config(tiny, epochs=2)
    cfg.update(run=name, task=f"tasks/{name}.py")
    return cfg, task


def last_lines(text: str, n: int = 6) -> str:
    """The last lines snakemake printed: the run's summary, then its own four (the log's
    path, the time, the error)."""
    return "\n".join(text.rstrip().splitlines()[-n:])


def failed_line(text: str) -> str:
    """The summary's ``failed`` line among the last lines printed."""
    return next((ln.split(None, 1)[1] for ln in last_lines(text).splitlines()
                 if ln.strip().startswith("failed ")), "")  # fmt: skip


def test_a_crash_on_rank_1_is_named(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 raises in its forward (``ddppipe launch``, as the train rule runs it): the
    launcher's last lines, the attempt record and the summary (text and HTML) name rank 1,
    the exception and the line of the task file, not rank 0's follow-on gloo error."""
    cfg, task = user_run(tmp_path, tiny, "crashy", CRASHING_TASK)
    run = tmp_path / "results" / "crashy"
    run.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # the task file is relative to the working directory
    resolve.write_resolved(cfg, run / "config.yaml")
    line = 1 + next(i for i, t in enumerate(CRASHING_TASK.splitlines()) if "raise Runtime" in t)
    started = time.monotonic()
    result = run_cli(
        "launch", f"--config={run / 'config.yaml'}", f"--data={tiny.data_dir}",
        f"--state={run / 'state'}", f"--checkpoint={run / 'train/final.pt'}",
        f"--metrics={run / 'train/metrics.jsonl'}", cwd=tmp_path, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    cause = (f"rank 1 on {socket.gethostname()}: RuntimeError: shape trouble in batch 5 at "
             f"tasks/crashy.py:{line} (in forward), step 5 (epoch 1)")  # fmt: skip
    history = json.loads((run / "state/attempts.json").read_text())
    assert [(a["outcome"], a["detail"]) for a in history] == [("crashed (exit 1)", cause)]
    failure = history[0]["failure"]
    assert (failure["rank"], failure["type"], failure["step"]) == (1, "RuntimeError", 5)
    assert f'{task}", line {line}, in forward' in failure["traceback"]
    assert f"training failed: {cause}" in result.stderr
    assert summary.build(run).lines[-1] == ("failed", cause)
    html = summary_html.render(summary.build(run))
    assert f'<tr class="waste"><th scope="row">failed</th><td>{cause}</td></tr>' in html
    assert not (run / "train/final.pt").exists()
    printed = [ln for ln in result.stderr.splitlines() if "failed" in ln]
    to_end = history[0]["end"] - failure["time"]
    print(f"(crash) ddppipe launch ran {wall:.1f}s, {to_end:.1f}s from rank 1's exception to "
          "the slot's end; it printed:", *printed, sep="\n")  # fmt: skip


@pytest.mark.slow  # through the DAG
def test_a_nan_loss_stops_the_run_at_its_step(tmp_path: Path, tiny: TinyData) -> None:
    """Rank 1's loss is NaN from the run's step 10 (epoch 2): every rank stops there, the run
    fails naming the step, exports nothing, keeps epoch 1's checkpoint and writes none after
    it; the train rule again refuses in seconds without training."""
    cfg, _ = user_run(tmp_path, tiny, "nan", NAN_TASK)
    result = snakemake(tmp_path, cfg, "--cores", "2", check=False)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    run = tmp_path / "results/nan"
    history = json.loads((run / "state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["non-finite loss at step 10 (epoch 2)"]
    assert failed_line(text) == "non-finite loss at step 10 (epoch 2)", last_lines(text)
    checkpoints = sorted(p.name for p in (run / "state/checkpoints").iterdir())
    assert checkpoints == ["ckpt-e0001-s000000"]
    assert not (run / "train").exists() or not any((run / "train").iterdir())
    assert not (run / "export").exists()
    # the train rule again (its command as the rule runs it): refused in seconds
    again = run_cli(
        "launch", f"--config={run / 'config.yaml'}", f"--data={tiny.data_dir}",
        f"--state={run / 'state'}", f"--checkpoint={run / 'train/final.pt'}",
        f"--metrics={run / 'train/metrics.jsonl'}", cwd=tmp_path, check=False,
    )  # fmt: skip
    assert again.returncode != 0
    assert "not training: the loss was not finite: non-finite loss at step 10" in again.stderr
    assert len(json.loads((run / "state/attempts.json").read_text())) == 1  # no new slot
    to_end = history[0]["end"] - history[0]["failure"]["time"]
    print(f"(NaN) {to_end:.1f}s from the stop to the slot's end; snakemake's last lines:\n"
          f"{last_lines(text)}")  # fmt: skip
