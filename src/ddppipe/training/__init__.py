"""What runs on the ranks, by what it holds:

- ``loop/``: a task's training loop (the trainer, its strategy, evaluation, optimizer and
  schedule, what the ranks agree on, how it takes its checkpoints, a sweep trial's pruning);
- ``script/``: a user's own torchrun script (the job API, the entry point that runs it);
- ``checkpoints/``: the checkpoint stores on disk (whole snapshots, sharded checkpoints);
- ``tracking/``: TensorBoard, MLflow and W&B, continued across requeues; the provenance;
- ``measuring/``: what a slot cost and where its time went, the compute peak, the heartbeat
  the hang watchdog reads.

The loop and the script import the three below them, never the other way round
(``lint-imports`` checks).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "job":  # the script API's import before training/ had packages
        from ddppipe.training.script import job

        return job
    raise AttributeError(f"module 'ddppipe.training' has no attribute {name!r}")
