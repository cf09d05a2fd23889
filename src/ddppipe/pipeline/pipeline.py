"""The workflow's one object: built from the config and the Snakemake workflow when the
Snakefile is read, it owns the runs, the run layout, the task's data, the image and the sweep,
with one method per rule input, parameter or resource the rules ask for."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from snakemake.exceptions import WorkflowError
from snakemake.io import directory
from snakemake.logging import logger

from ddppipe import tasks
from ddppipe.apptainer import gpu_check
from ddppipe.apptainer import tool as apptainer
from ddppipe.launching import launch
from ddppipe.parallel import devices
from ddppipe.pipeline.images import Images
from ddppipe.pipeline.sweep_inputs import SLOT, SweepInputs
from ddppipe.runstate import state as run_state
from ddppipe.runstate import sweep_rounds
from ddppipe.settings import config as configs
from ddppipe.settings import data_sets, layout, run_spec, runs
from ddppipe.slurm import call_executor, request
from ddppipe.sweeps import legacy_names
from ddppipe.tasks import prepare_args

BESIDE = "ddppipe_beside"  # the resource of the rules beside a training
# (`threads: 0`: evaluation, plots, the attempt page, export, the summary): Snakemake's local
# executor runs each job in one of cores + 5 threads, and a zero-thread job past them waits in
# its queue, so a finished trial's plots would hold back the next trial's config and the round
# that suggests it.
BESIDE_AT_ONCE = 3


class Pipeline:
    """The workflow of ``config`` (validated) in ``workflow``, a Snakemake workflow whose
    ``checkpoints`` a model-based sweep's rounds are. Raises WorkflowError (a message, no
    traceback) on what the config gets wrong."""

    def __init__(self, config: dict[str, Any], workflow: Any, checkpoints: Any) -> None:
        self.config, self.workflow = config, workflow
        self.run = config["run"]
        try:
            # Every run of this config: the base run, the scaling study's, the sweep's trials;
            # each resolved once in this process (runs.spec: its device decided, its preset).
            self.runs = runs.Runs(config, self._decide_device, sweep_rounds.trials)
            self.kind = layout.kind(config)  # a task (model + data) or a torchrun script
            self.source = (tasks.locate_script(config["script"]) if self.kind == "script"
                           else tasks.locate(config["task"]))  # fmt: skip
        except (configs.ConfigError, tasks.TaskError) as e:
            raise WorkflowError(str(e)) from None
        # Trials on disk under their names from before "+" joined their keys: renamed once.
        for line in legacy_names.rename(
            [s.name for s in (self.runs.sweep, self.runs.scaling) if s is not None]
        ):
            logger.info(f"ddppipe: {line}")
        self.layout = layout.RunLayout("{run}")  # patterns of the {run} wildcard
        # The task's prepared data, resources/<data>/: one folder per distinct set of the
        # values its prepare() reads (the base config's: resources/<task>), of no run.
        self.data_sets = data_sets.DataSets(
            self.source.name, config["task_args"], self._prepare_reads()
        )
        self.images = Images(self.runs, self.run, config["container"]["recipe"],
                             workflow.basedir, self.kind == "script")  # fmt: skip
        self._gpu_image_check = gpu_check.GpuImageCheck()  # once per device and container
        self.task_requirements = self.images.requirements()
        script = self.kind == "script"
        self.sweep = SweepInputs(self.runs, self.kind, checkpoints,
                                 None if script else self.source.path)  # fmt: skip
        workflow.register_resource(BESIDE, BESIDE_AT_ONCE)
        if self.sweep.slots() is not None:
            workflow.register_resource(SLOT, self.sweep.slots())
        if self.sweep.rounds_note():
            logger.info(self.sweep.rounds_note())
        # A GPU run (container.mode apptainer) needs an image with CUDA: a config error,
        # before any job (each trial's too, at its write_config). Judged on the base image
        # and its recipe: a task's layer keeps their torch and CUDA.
        self.run_gpus(self.run)

    # -- where the call runs, and each run's device ---------------------------------------

    def on_slurm(self) -> bool:
        """Whether this snakemake call submits to SLURM: its executor plugin once chosen
        (none at all for --report); while the Snakefile is read, as its command line and
        profile name it (ddppipe.slurm.call_executor)."""
        plugin = self.workflow.executor_plugin
        if plugin is not None:
            return plugin.name == "slurm"
        return call_executor.executor_of_call(sys.argv) == "slurm"

    def _decide_device(self, run_config: dict[str, Any]) -> bool:
        """Whether a run trains on GPUs: launch.device decided, the one place
        (ddppipe.parallel.devices.trains_on_gpus), once per run (runs.spec records it)."""
        return devices.trains_on_gpus(run_config, self.on_slurm(),
                                      recipe=self.images.recipe())  # fmt: skip

    def run_gpus(self, run: str) -> str:
        """ "yes" when the run ``run`` trains on GPUs (its spec), else "no"; a GPU run's image
        must have CUDA (ddppipe.apptainer.gpu_check), a config error otherwise."""
        spec = self.runs.spec(run)
        try:
            self._gpu_image_check(spec, self.images.recipe())
        except apptainer.ContainerError as e:
            raise WorkflowError(str(e)) from None
        return "yes" if spec.gpus else "no"

    def threads(self, wildcards: Any) -> int:
        """Rule train's cores on this machine: its run's processes' (ddppipe.launching.launch)."""
        return launch.job_threads(self.runs.spec(wildcards.run))

    def train_resources(self) -> dict[str, Any]:
        """Rule train's SLURM resources, each a function of the run (its request; on SLURM
        its memory fitted to the partition's nodes)."""
        return request.train_resources(self.runs, self.on_slurm())

    def run_states(self) -> list[run_state.StateDir]:
        """The state folders of every run this workflow may train (the main run, the
        study's)."""
        return [run_state.StateDir(layout.RunLayout(r).state) for r in self.runs.names()]

    def training_state(self, job: Any) -> run_state.StateDir | None:
        """The state folder of a train job's run (None for another rule's job)."""
        if job.name != "train":
            return None
        return run_state.StateDir(layout.RunLayout(job.wildcards_dict["run"]).state)

    # -- the task's data ------------------------------------------------------------------

    def _prepare_reads(self) -> list[str] | None:
        """The task_args the task's prepare() reads (its PREPARE_ARGS; None: all of them)."""
        if self.kind == "script":
            return None
        try:
            return prepare_args.read(self.source.path)
        except prepare_args.PrepareArgsError as e:
            raise WorkflowError(str(e)) from None

    def run_data(self, run: str) -> str:
        """The prepared data folder the run ``run`` trains on (ddppipe.settings.data_sets)."""
        return f"resources/{self.data_sets.name(self.runs.config(run)['task_args'])}"

    def data_settings(self, wildcards: Any) -> str:
        """What the data folder resources/{data} is prepared with (task and task_args), as
        JSON."""
        for run in self.runs.names():
            cfg = self.runs.config(run)
            if self.data_sets.name(cfg["task_args"]) == wildcards.data:
                cfg["task_args"] = self.data_sets.task_args(cfg["task_args"])
                return json.dumps(configs.data_settings(cfg))
        raise WorkflowError(f"no run of this config trains on resources/{wildcards.data}")

    def data_input(self) -> Any:
        """The run's data manifest as an input; a script finds its own data."""
        return self.task_only(lambda wildcards: f"{self.run_data(wildcards.run)}/manifest.json")

    @staticmethod
    def data_option(wildcards: Any, input: Any) -> str:
        """`--data FOLDER` of a rule whose input.data is a manifest ('' for a script)."""
        return f"--data {os.path.dirname(input.data)}" if input.data else ""

    # -- a run's files ----------------------------------------------------------------------

    def task_only(self, path: Any) -> Any:
        """``path`` in a task run; none in a script run (no prepared data, checkpoint,
        evaluation)."""
        return [] if self.kind == "script" else path

    def result_output(self, path: Any) -> Any:
        """A run's result as an output: a script's is a folder of files."""
        return directory(path) if self.kind == "script" else path

    def all_outputs(self) -> list[str]:
        return layout.RunLayout(self.run).targets(self.kind)

    def warm_datasets(self, most: int = 4) -> list[dict[str, Any]]:
        """The task datasets a warm server keeps for the ranks: each distinct prepared data
        folder and task_args of this call's runs (at most ``most``; a script run has none),
        the trials first (a sweep's call trains them)."""
        if self.kind == "script":
            return []
        found: list[dict[str, Any]] = []
        for run in reversed(self.runs.names()):
            item = {"task": self.config["task"], "data_dir": self.run_data(run),
                    "args": run_spec.plain(self.runs.spec(run).task_args)}  # fmt: skip
            if item not in found:
                found.append(item)
        return found[:most]
