"""A packed image folder on the SLURM test cluster: the DAG packs the images into one SquashFS
image on the submitting machine (``data.pack: squashfs``), the two nodes each stage it once to
their own folder and train from it, mounted there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster
from tests.test_slurm import logs, on_cluster, snakemake_slurm
from tests.test_tasks_builtin import write_images
from tests.tiny import default_config

pytestmark = pytest.mark.slurm


def test_a_squashfs_image_is_staged_on_each_node_and_trained_from(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    root = tmp_path / "images"
    write_images(root, per_class=16)
    cfg = on_cluster(default_config(), slurm_cluster, nodes=2, procs=1)
    cfg.update(
        run="packed2n",
        task="ddppipe.tasks.imagefolder",
        task_args={"root": str(root), "image_size": 16, "width": 8},
        data={"pack": "squashfs"},
    )
    cfg["train"].update(epochs=1, batch_size=8, eval_batch_size=16)
    # Each node its own folder, as a node's local disk would be ($SLURMD_NODENAME: srun's).
    cfg["launch"]["stage_data"] = str(tmp_path / "local" / "$SLURMD_NODENAME")
    workdir = tmp_path / "wd"
    result = snakemake_slurm(slurm_cluster, workdir, cfg)
    assert result.returncode == 0, logs(workdir, result)
    (data,) = (workdir / "resources").glob("imagefolder*/manifest.json")
    found = json.loads(data.read_text())
    digest, image = found["digest"], found["squashfs"]["image"]
    staged = sorted((tmp_path / "local").glob(f"*/ddppipe-{os.getuid()}/data-{digest}"))
    assert [p.parent.parent.name for p in staged] == sorted(slurm_cluster.nodes), staged
    for folder in staged:  # the image, checked as it was copied
        assert sorted(p.name for p in folder.iterdir()) == ["index.json", "manifest.json", image]
        assert (folder / image).read_bytes() == (data.parent / image).read_bytes()
    metrics = json.loads((workdir / "results/packed2n/eval/metrics.json").read_text())
    assert metrics["test_accuracy"] > 0.5  # three colours
    (slot,) = json.loads((workdir / "results/packed2n/train/attempts.json").read_text())
    assert slot["efficiency"]["stage_s"] > 0 and sorted(slot["nodes"]) == sorted(
        slurm_cluster.nodes
    )
