"""The classic DataLoader-based DDP MNIST script, re-implemented as the benchmark baseline.

What the seeds' users run today: torchvision's MNIST dataset read from IDX files in a local
folder, per-sample ``ToTensor`` + ``Normalize`` transforms, a ``DistributedSampler`` and a
``DataLoader`` with worker processes, the same CNN as ddppipe, Adadelta (lr 1.0) with StepLR
(gamma 0.7) and 64 images per rank per step; every rank evaluates the whole test set after each
epoch. Launch it with torchrun::

    torchrun --standalone --nproc-per-node=2 bench/classic_ddp_mnist.py --root DIR

``DIR/MNIST/raw/`` must hold the four decompressed IDX files. Rank 0 prints one JSON line per
epoch (``time`` is the Unix time at the end of the epoch's evaluation) so that
``bench/benchmark.py`` can read throughput and time to accuracy. ``--stop-at`` and
``--max-steps`` only cut the run short; they change nothing before the cut.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Net(nn.Module):
    """The seeds' CNN, returning log-probabilities as the classic script does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train_epoch(
    model: nn.Module,
    device: torch.device,
    loader: DataLoader,
    optimizer: optim.Optimizer,
    max_steps: int | None,
) -> tuple[float, int]:
    """One epoch (or ``max_steps`` steps); return (seconds, this rank's images)."""
    model.train()
    images = 0
    start = time.perf_counter()
    for step, (data, target) in enumerate(loader):
        if max_steps is not None and step >= max_steps:
            break
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        images += len(data)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, images


def test(model: nn.Module, device: torch.device, loader: DataLoader) -> tuple[float, float]:
    """Mean loss and accuracy over the whole test set."""
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    n = len(loader.dataset)
    return loss / n, correct / n


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="folder holding MNIST/raw/<IDX files>")
    ap.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    ap.add_argument("--test-batch-size", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    ap.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help="stop after the first epoch whose test accuracy reaches this fraction",
    )
    ap.add_argument("--max-steps", type=int, default=None, help="steps per epoch at most")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    train_set = datasets.MNIST(args.root, train=True, download=False, transform=transform)
    test_set = datasets.MNIST(args.root, train=False, download=False, transform=transform)
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader_kwargs = {"num_workers": args.num_workers, "pin_memory": cuda}
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, **loader_kwargs
    )
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, **loader_kwargs)

    model = DDP(Net().to(device), device_ids=[local_rank] if cuda else None)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        seconds, images = train_epoch(model, device, train_loader, optimizer, args.max_steps)
        test_loss, accuracy = test(model, device, test_loader)
        scheduler.step()
        if rank == 0:
            print(
                json.dumps(
                    {
                        "epoch": epoch,
                        "time": time.time(),
                        "train_seconds": seconds,
                        "train_images": images * world_size,
                        "images_per_s": images * world_size / seconds,
                        "test_loss": test_loss,
                        "test_accuracy": accuracy,
                        "world_size": world_size,
                    }
                ),
                flush=True,
            )
        if args.stop_at is not None and accuracy >= args.stop_at:
            break  # every rank evaluated the same model, so all ranks stop together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
