"""Which executor a ``snakemake`` call runs, while its Snakefile is read.

Snakemake chooses the executor plugin only after reading the Snakefile (``workflow.
executor_plugin`` is None until then), but a run's device (``launch.device: auto``: CPUs on
SLURM) and a packed sweep's rules are decided while it is read. The call says it: its
``--executor``/``-e``, else the ``executor:`` of its profile (``--profile``, or
``$SNAKEMAKE_PROFILE``; a name is looked up where Snakemake looks), else ``local``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml


def _option(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--opt value`` or ``--opt=value``)."""
    found = None
    for k, arg in enumerate(argv):
        for name in names:
            if arg == name and k + 1 < len(argv):
                found = argv[k + 1]
            elif arg.startswith(f"{name}="):
                found = arg.split("=", 1)[1]
    return found


def profile_folder(name: str, env: Mapping[str, str]) -> Path | None:
    """The folder of profile ``name``: a path, or a name under Snakemake's profile folders."""
    if Path(name).is_dir():
        return Path(name)
    home = Path(env.get("HOME", "~")).expanduser()
    config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    for base in (config_home / "snakemake", Path("/etc/xdg/snakemake")):
        if (base / name).is_dir():
            return base / name
    return None


def executor_of_call(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The executor the call ``argv`` (snakemake's command line) runs: ``slurm``, ``local``..."""
    env = os.environ if env is None else env
    named = _option(argv, "--executor", "-e")
    if named:
        return named
    profile = _option(argv, "--profile") or env.get("SNAKEMAKE_PROFILE")
    folder = profile_folder(profile, env) if profile else None
    if folder is not None and (folder / "config.yaml").is_file():
        settings = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        if settings.get("executor"):
            return str(settings["executor"])
    return "local"
