"""A task that imports a package installed neither where a step runs nor in an image: one
error naming the package, the step, where it ran, and both fixes (no image needed: the
host's side, container.mode none). In the image: tests/test_task_layer.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import yaml

from tests.conftest import run_cli
from tests.tiny import REPO, default_config

BLOBSDEP = REPO / "tests" / "data" / "blobsdep.py"  # a user's task file: it imports blobfmt


def fixes(step: str, task: Path) -> str:
    return (
        f"{step}: task mytasks/blobsdep.py ({task}) imports blobfmt, which is not installed in "
        f"this machine's Python environment ({sys.prefix}). Either run it in an image with it, "
        "container: {mode: apptainer, requirements: [blobfmt==VERSION]} (`pip index versions "
        "blobfmt` lists the versions; a module's pip package may have another name), or "
        f"install it where this step runs: {sys.executable} -m pip install blobfmt"
    )


def test_a_package_in_neither_place_is_named_with_the_step_and_both_fixes(tmp_path: Path) -> None:
    """write_config's check and prepare_data's prepare(), whether the task imports the package
    at its top or inside a function."""
    assert importlib.util.find_spec("blobfmt") is None, "blobfmt must be absent from the host"
    task = tmp_path / "mytasks" / "blobsdep.py"
    task.parent.mkdir()
    shutil.copy2(BLOBSDEP, task)
    cfg = default_config()
    cfg.update(task="mytasks/blobsdep.py", task_args={})
    out = tmp_path / "config.yaml"
    result = run_cli("resolve-config", "--json", json.dumps(cfg), "--gpus", "no", "--out",
                     str(out), cwd=tmp_path, check=False)  # fmt: skip
    assert result.returncode != 0 and not out.exists()
    step = "write_config (ddppipe resolve-config)"
    assert f"ddppipe resolve-config: error: {fixes(step, task)}\n" in result.stderr
    # imported inside prepare(): the same error from the data rule's command
    text = task.read_text().replace("import blobfmt\n", "")
    task.write_text(text.replace('    """Points', '    import blobfmt\n\n    """Points'))
    settings = tmp_path / "blobsdep.yaml"
    settings.write_text(yaml.safe_dump({"task": "mytasks/blobsdep.py", "task_args": {}}))
    result = run_cli("prepare", "--settings", str(settings), "--dest", "data", cwd=tmp_path,
                     check=False)  # fmt: skip
    step = "prepare_data (ddppipe prepare)"
    assert f"ddppipe prepare: error: {fixes(step, task)}\n" in result.stderr, result.stderr
