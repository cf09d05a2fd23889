"""The data subcommand: run a task's ``prepare()`` and write the data manifest (data rule)."""

from __future__ import annotations

import sys
from pathlib import Path

from ddppipe import tasks
from ddppipe.data import manifest, squashfs
from ddppipe.settings import config


def prepare(settings: Path, dest: Path) -> int:
    """``ddppipe prepare``: the task named in ``settings`` prepares its data in ``dest``."""
    found_settings = config.load_data_settings(settings)
    task = tasks.load(found_settings["task"], step="prepare_data (ddppipe prepare)")
    task_args = tasks.validate_args(task, found_settings["task_args"])
    dest.mkdir(parents=True, exist_ok=True)
    task.call("prepare", dest, task_args)
    records = None
    if found_settings["data"]["pack"] == "squashfs":  # the folder the task reads, as one image
        arg = task.folder_arg(step="data.pack: squashfs")
        image = squashfs.write(Path(task_args[arg]).expanduser(), dest, arg)
        records = {squashfs.KEY: {"image": image, "arg": arg}}
    found = manifest.write(dest, task.source.as_dict(), task_args, records)
    print(f"{len(found['files'])} file(s) in {dest}, digest {found['digest']}",
          file=sys.stderr)  # fmt: skip
    return 0
