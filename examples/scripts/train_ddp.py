"""Train a small CNN on scikit-learn's handwritten digits with DDP: an example torchrun script.

ddppipe launches it like its own training (local torchrun or an srun step, preflight, image,
requeues): ``snakemake --cores all --config script=examples/scripts/train_ddp.py
'script_args=[--epochs, 3]'``. The data ships with scikit-learn, so it runs offline.

What ddppipe asks of a script: stop when ``job.should_stop()`` says so (a SLURM slot ends, a
preemption signal arrived) after saving a checkpoint in ``job.checkpoint_dir()``, exit with
``job.STOP``, and resume from that checkpoint when started again. Everything is seeded, so
a run stopped and resumed any number of times ends with bitwise the same weights as one
that ran straight through (at the same number of processes).
"""

from __future__ import annotations

import argparse
import os
import sys
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddppipe import job

SEED = 0


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 images scaled to [0, 1], split 75/25 (the same split on every rank)."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16  # (N, 1, 8, 8)
    y = torch.tensor(data.target)
    train, test = train_test_split(
        range(len(y)), test_size=0.25, random_state=SEED, stratify=data.target
    )
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10),
    )  # fmt: skip


def save_atomically(obj: object, path: Path) -> None:
    """Write to a temporary file, then rename it: a kill never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    args = parser.parse_args()

    info = job.info()  # rank, local_rank, world_size, device, node, attempt
    device = torch.device(info.device)
    # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says where to meet.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS too
    torch.use_deterministic_algorithms(True)

    torch.manual_seed(SEED)  # the same initial weights everywhere (DDP broadcasts rank 0's)
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(model)

    train, test = digits()
    # Each rank trains its own part of every epoch's shuffle, which depends only on (SEED, epoch).
    sampler = DistributedSampler(train, info.world_size, info.rank, seed=SEED, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)

    checkpoint = job.checkpoint_dir() / "checkpoint.pt"
    epoch, start_step = 0, 0  # where to start: the epoch, and the batches of it already done
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, start_step = state["epoch"], state["step"]
        if info.rank == 0:
            print(f"attempt {info.attempt} on {info.node}: resuming at epoch {epoch} step "
                  f"{start_step}", flush=True)  # fmt: skip

    def save(epoch: int, step: int) -> None:
        if info.rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "step": step}  # fmt: skip
            save_atomically(state, checkpoint)
        dist.barrier()  # nobody leaves before the checkpoint is on disk

    while epoch < args.epochs:
        sampler.set_epoch(epoch)  # the sampler's only state: a resumed epoch gets its shuffle back
        ddp.train()
        # On resume, skip the batches trained before the stop (they are still loaded: cheap here).
        for step, (x, y) in enumerate(islice(loader, start_step, None), start=start_step):
            if job.should_stop():  # collective: every rank gets the same answer
                save(epoch, step)
                dist.destroy_process_group()
                sys.exit(job.STOP)  # "continue me in the next slot"
            global_step = epoch * steps_per_epoch + step
            # Dropout masks from (seed, step, rank), not from the RNG's history: resumable.
            torch.manual_seed((SEED * 1_000_003 + global_step) * 4099 + info.rank)
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            if info.rank == 0:
                job.log(global_step, loss=loss.item())  # rank 0's batch
        epoch, start_step = epoch + 1, 0
        if info.rank == 0:  # the test set is small: rank 0 evaluates all of it
            model.eval()
            with torch.no_grad():
                x, y = test.tensors
                accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean()
            job.log(epoch * steps_per_epoch - 1, test_accuracy=accuracy.item())  # last step
        save(epoch, 0)  # a checkpoint every epoch

    if info.rank == 0:
        save_atomically(model.state_dict(), job.output_dir() / "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
