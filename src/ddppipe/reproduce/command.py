"""``ddppipe reproduce PATH``: check, train again in a new run folder, compare, one verdict.

Exit status: 0 identical, 1 differs, 2 refused before training (a check that would make it
another run: the data changed); the command's errors (no record, no data, a failed training)
exit 2 too.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from ddppipe import tasks
from ddppipe.apptainer import identity
from ddppipe.apptainer.tool import ContainerError
from ddppipe.core import system
from ddppipe.parallel import precision, software
from ddppipe.reproduce import causes, checks, compare, plan, rerun, source, verdict
from ddppipe.settings import layout

IDENTICAL, DIFFERS, REFUSED = 0, 1, 2


def _here() -> tuple[str, str, str]:
    """This machine's device kind and model as a record names them, and its CPU model."""
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0), system.cpu_model()
    return "cpu", "cpu", system.cpu_model()


def _precision_here() -> str:
    """What ``train.precision: auto`` becomes on this machine's device (a reproduction trains
    on GPU 0 or the CPU)."""
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return precision.on_this_node(precision.AUTO, device)


def run_checks(run: source.Recorded, data: Path) -> list[checks.Finding]:
    """Every check before training, in the order they print."""
    record, cwd = run.provenance, plan.workdir(run)
    task_ref = (run.config or {}).get("task") or (record.get("task") or {}).get("ref")
    current = tasks.locate(task_ref, cwd).as_dict() if task_ref else None
    image = checks.image(record.get("container"))
    return [
        checks.git(record.get("git") or {}, cwd),
        checks.data(record.get("data_sha256") or {}, data),
        checks.task(record.get("task"), current),
        checks.config(record["train_config"], run.config),
        _packages(record, image),
        image,
        checks.device(
            record["training"],
            (record.get("software") or {}).get("cpu"),
            _here(),
            _precision_here(),
        ),
    ]


def _packages(record: dict[str, Any], image: checks.Finding) -> checks.Finding:
    """The packages check: against this environment's, or a container run's image's (and its
    task layer's, from the layer's info JSON beside it)."""
    recorded = (record.get("software") or {}).get("packages")
    container = record.get("container")
    if not container:
        return checks.packages(recorded, software.packages())
    labels, added = None, None
    if image.status != "ok" and Path(container["path"]).is_file():
        with contextlib.suppress(ContainerError):  # no apptainer here: unknown
            labels = identity.labels(container["path"])
    layer = container.get(identity.LAYER)
    if image.status != "ok" and layer:
        info = identity.info_path(layer["path"])
        added = json.loads(info.read_text())["installed"] if info.is_file() else []
    return checks.image_packages(recorded, container, image, labels, added)


def reproduce(path: Path, data: Path | None = None) -> int:
    """Check the run at ``path``, train it again, compare; print the findings and the verdict."""
    run = source.find(path)
    data_dir = plan.data_folder(run, data)
    findings = run_checks(run, data_dir)
    print(f"checks of {run.root} (trained on {data_dir}):")
    for finding in findings:
        print(f"  {finding.line()}")
    refused = [f for f in findings if f.status == "refuse"]
    if refused:
        print(f"refused before training: {refused[0].text}", file=sys.stderr)
        return REFUSED
    root = plan.new_root(run)
    print(f"training the reproduction in {root}", flush=True)
    cfg = plan.config(run, layout.RunLayout.of_root(root).run, _here()[0] == "cuda")
    for note in plan.dropped(run):
        print(f"  {note}")
    at = plan.pruned_at(run)
    if at is not None and cfg.get("trial"):
        print(f"  pruned   the trial was pruned at epoch {at}: reproduced and compared to it")
    rerun.train(cfg, data_dir, root, plan.workdir(run))
    again = source.find(root)
    found = compare.compare(run, again)
    if run.split_epochs:
        print(
            f"  epochs   {', '.join(map(str, sorted(run.split_epochs)))}: resumed inside, the "
            "run's train_loss covers the steps after the resume only (not compared)"
        )
    for tensor in found.tensors:
        print(f"  weights  {tensor.name}: largest difference {tensor.largest:.3g}")
    if not found.tensors:
        print(f"  weights  bitwise identical ({again.weights})")
    print(verdict.line(found, causes.of(run, again, findings), run.steps_per_epoch))
    return IDENTICAL if found.identical else DIFFERS
