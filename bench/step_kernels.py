"""The kernels a training step launches: ddppipe's step against the plainest loop's, counted
(issue 59: "the loop's own per-step kernels merged or removed").

Every ATen operation dispatched in the steady steps of a one-rank run is counted (a
``TorchDispatchMode``: on a GPU each is a kernel launch, or a host-side op the GPU waits
behind) and put in one of four parts by the Python stack that dispatched it: the optimizer
(``torch/optim``), the backward (under ``torch.autograd.backward``), the model's forward (a
module's ``forward``), and the rest: the loop's own work (for ddppipe: its loss window, the
agreement, the batch's gather; for the plain loop: the batch's indexing). Counts, not times:
they do not depend on the machine's load.

``python bench/step_kernels.py --from DIR``: DIR is a kept run of ``bench/step_overhead.py
--workload mlp --ranks 1 --keep DIR`` (its config, task and data); ddppipe's ``train`` runs in
a subprocess of this file (``--probe``) from any checkout (``--repo``: a checkout whose
``src`` is imported instead of this one's, to count an older commit's step the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve()
PARTS = ("forward", "backward", "optimizer", "loop's own")
SKIP = 5  # the first steps (warm-up, a tracker opened, the first agreement) are not counted
COUNTED = 40  # the steady steps counted


def part_of(frame: FrameType | None) -> str:
    """Which part of a step the op dispatched under ``frame`` belongs to."""
    forward = False
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/optim/" in name:
            return "optimizer"
        if name.endswith("/torch/autograd/__init__.py") and frame.f_code.co_name == "backward":
            return "backward"
        if ("/torch/nn/" in name and "/torch/nn/parallel/" not in name) or (
            frame.f_code.co_name == "forward" and "/torch/" not in name
        ):
            forward = True  # a module's or the loss's (DDP's wrapper is not the model)
        frame = frame.f_back
    return "forward" if forward else "loop's own"


def counting_mode(step_of: Any) -> Any:
    """A dispatch mode counting ops by (step, part); ``step_of()`` says the step (None: not in
    one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[tuple[int, str]] = Counter()
            self.names: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            step = step_of()
            if step is not None and SKIP <= step < SKIP + COUNTED:
                part = part_of(sys._getframe(1))
                self.ops[step, part] += 1
                if part == "loop's own":
                    self.names[str(func)] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def per_step(mode: Any) -> dict[str, Any]:
    steps = {s for s, _ in mode.ops}
    parts = {p: sum(n for (_, q), n in mode.ops.items() if q == p) / max(1, len(steps))
             for p in PARTS}  # fmt: skip
    own = {k: v / max(1, len(steps)) for k, v in mode.names.most_common(12)}
    return {"steps": len(steps), "parts": parts, "own_ops": own}


def probe(out: Path, argv: list[str]) -> None:
    """``ddppipe argv`` (its ``train``) in this process, a world of one, counted into ``out``."""
    os.environ.pop("DDPPIPE_WARM_SOCKET", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"):  # fmt: skip
        os.environ.pop(key, None)
    from ddppipe.cli import ranks
    from ddppipe.cli.main import main
    from ddppipe.runstate import failures

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    ranks._exit_now = exit_now  # (its os._exit would skip writing the counts)
    mode = counting_mode(lambda: failures._step[0] if failures._step is not None else None)
    try:
        with mode:
            main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        out.write_text(json.dumps(per_step(mode)))


def plain(kept: Path) -> dict[str, Any]:
    """The plain loop of bench/step_overhead.py on the kept run's data and recipe, counted."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent))
    import step_overhead  # the same loop the step figures compare with

    run = next(p for p in (kept / "results").iterdir() if p.name.startswith("mlp-1r"))
    import yaml

    resolved = yaml.safe_load((run / "config.yaml").read_text())
    spec = {"workload": "mlp", "task_args": resolved["task_args"], "seed": 0,
            "task_file": str(kept / resolved["task"]) if not Path(resolved["task"]).is_absolute()
            else resolved["task"], "data": str(kept / "resources" / "blobs")}  # fmt: skip
    x_all, y_all, model = step_overhead.plain_data(spec)
    train = resolved["train"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=train["lr"] or 1e-3,
        fused=True,
        weight_decay=train["weight_decay"] or 0.0,
    )  # (ddppipe's: fused)
    batch, n = train["batch_size"], len(y_all)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g)
    step = [0]
    mode = counting_mode(lambda: step[0])
    with mode:
        for k in range(SKIP + COUNTED):
            step[0] = k
            idx = perm[k * batch : (k + 1) * batch]
            x, y = x_all[idx], y_all[idx]
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return per_step(mode)


def ddppipe(kept: Path, repo: Path) -> dict[str, Any]:
    run = next(p for p in (kept / "results").iterdir() if p.name.startswith("mlp-1r"))
    work = kept / "kernels"
    work.mkdir(exist_ok=True)
    out = work / "counts.json"
    argv = ["train", f"--config={run / 'config.yaml'}", f"--data={kept / 'resources' / 'blobs'}",
            f"--state={work / 'state'}", f"--checkpoint={work / 'final.pt'}",
            f"--metrics={work / 'metrics.jsonl'}"]  # fmt: skip
    for stale in ("state", "final.pt", "metrics.jsonl"):
        subprocess.run(["rm", "-rf", str(work / stale)], check=True)
    env = {**os.environ, "PYTHONPATH": f"{repo / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, str(HERE), "--probe", str(out), *argv], cwd=kept,
                            env=env, capture_output=True, text=True, check=False)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"ddppipe's counted run failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="kept", type=Path, help="a kept step_overhead run")
    parser.add_argument(
        "--repo",
        type=Path,
        default=HERE.parent.parent,
        help="the checkout whose ddppipe is counted (default: this one)",
    )
    parser.add_argument("--probe", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        try:
            probe(Path(args.probe[0]), args.probe[1:])
        except Exception:
            traceback.print_exc()
            raise
        return
    if args.kept is None:
        parser.error("--from DIR: a run kept by bench/step_overhead.py --keep DIR")
    ours, theirs = ddppipe(args.kept, args.repo.resolve()), plain(args.kept)
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    print(
        f"ATen ops a step, the MLP at 1 rank, steps {SKIP}-{SKIP + COUNTED - 1}; "
        f"ddppipe at {commit or args.repo}"
    )
    print("| loop | " + " | ".join(PARTS) + " | all |")
    print("|---|" + "---:|" * (len(PARTS) + 1))
    for name, c in (("ddppipe", ours), ("plain", theirs)):
        row = [c["parts"][p] for p in PARTS]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {sum(row):.1f} |")
    print("ddppipe's own ops a step:", json.dumps(ours["own_ops"]))
    print("the plain loop's own ops a step:", json.dumps(theirs["own_ops"]))


if __name__ == "__main__":
    main()
