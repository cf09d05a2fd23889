# Paths and helpers shared by the rules.
import glob
import json
import os
import re
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from ddppipe.slurm import cluster_policy as ddp_cluster_policy
from ddppipe.slurm import call_executor as ddp_call_executor
from ddppipe.slurm import executor as ddp_executor
from ddppipe.settings import config as ddp_config
from ddppipe.settings import layout as ddp_layout
from ddppipe.runstate import state as ddp_state
from ddppipe.apptainer import gpu_check as ddp_gpu_check
from ddppipe.apptainer import identity as ddp_identity
from ddppipe.apptainer import requirements as ddp_requirements
from ddppipe.apptainer import running as ddp_running
from ddppipe.apptainer import tool as ddp_apptainer
from ddppipe.parallel import devices as ddp_devices
from ddppipe.launching import launch as ddp_launch
from ddppipe.launching import warm as ddp_warm
from ddppipe.core import env_names as ddp_env_names
from ddppipe.pipeline import in_order as ddp_in_order
from ddppipe.pipeline import snakemake_changes as ddp_snakemake_changes
from ddppipe.packing import allocation as ddp_allocation
from ddppipe.packing import pool as ddp_pool
from ddppipe.settings import run_spec as ddp_run_spec
from ddppipe.settings import runs as ddp_runs
from ddppipe.settings import sweep as ddp_sweep
from ddppipe.settings import data_sets as ddp_data_sets
from ddppipe.tasks import prepare_args as ddp_prepare_args
from ddppipe.sweeps import legacy_names as ddp_legacy_names
from ddppipe.slurm import request as ddp_slurm_request
from ddppipe import tasks as ddp_tasks

RUN = config["run"]


def decide_device(run_config):
    """Whether a run trains on GPUs: launch.device decided, the one place
    (ddppipe.parallel.devices.trains_on_gpus), once per run (RUNS.spec records it)."""
    return ddp_devices.trains_on_gpus(run_config, on_slurm(), recipe=image_recipe())


try:
    # Every run of this config: the base run, the scaling study's, the sweep's trials; each
    # resolved once in this process (RUNS.spec: its device decided, its preset applied).
    RUNS = ddp_runs.Runs(config, decide_device)
except ddp_config.ConfigError as e:
    raise WorkflowError(str(e)) from None
# Trials on disk under their names from before "+" joined their keys: renamed once.
for line in ddp_legacy_names.rename(
    [s.name for s in (RUNS.sweep, RUNS.scaling) if s is not None]
):
    logger.info(f"ddppipe: {line}")
# What the run trains: a task (model + data, prepared by the data rule) or a torchrun script.
KIND = ddp_layout.kind(config)
# Every path of a run (ddppipe.settings.layout); RUN_LAYOUT's are patterns of the {run} wildcard.
RUN_LAYOUT = ddp_layout.RunLayout("{run}")
try:
    SOURCE = (
        ddp_tasks.locate_script(config["script"])
        if KIND == "script"
        else ddp_tasks.locate(config["task"])
    )
except ddp_tasks.TaskError as e:
    raise WorkflowError(str(e)) from None


def prepare_reads():
    """The task_args the task's prepare() reads (its PREPARE_ARGS; None: all of them)."""
    if KIND == "script":
        return None
    try:
        return ddp_prepare_args.read(SOURCE.path)
    except ddp_prepare_args.PrepareArgsError as e:
        raise WorkflowError(str(e)) from None


# The task's prepared data, resources/<data>/: one folder per distinct set of the values its
# prepare() reads (the base config's: resources/<task>), depending on no run.
DATA_SETS = ddp_data_sets.DataSets(SOURCE.name, config["task_args"], prepare_reads())


def run_data(run):
    """The prepared data folder the run ``run`` trains on (ddppipe.settings.data_sets)."""
    return f"resources/{DATA_SETS.name(RUNS.config(run)['task_args'])}"


def data_settings(wildcards):
    """What the data folder resources/{data} is prepared with (task and task_args), as JSON."""
    for run in RUNS.names():
        cfg = RUNS.config(run)
        if DATA_SETS.name(cfg["task_args"]) == wildcards.data:
            cfg["task_args"] = DATA_SETS.task_args(cfg["task_args"])
            return json.dumps(ddp_config.data_settings(cfg))
    raise WorkflowError(f"no run of this config trains on resources/{wildcards.data}")


def data_folder(wildcards, input):
    """The folder of the prepared data a rule reads (its input.data, the manifest)."""
    return os.path.dirname(input.data)


def task_only(path):
    """``path`` in a task run; none in a script run (no prepared data, checkpoint, evaluation)."""
    return [] if KIND == "script" else path


def result_output(path):
    """A run's result as an output: a script's is a folder of files."""
    return directory(path) if KIND == "script" else path


def data_input():
    """The run's data manifest as an input; a script finds its own data."""
    return task_only(lambda wildcards: f"{run_data(wildcards.run)}/manifest.json")


def all_outputs():
    return ddp_layout.RunLayout(RUN).targets(KIND)


def on_slurm():
    """Whether this snakemake call submits to SLURM: its executor plugin once chosen (none at
    all for --report); while the Snakefile is read, as its command line and profile name it
    (ddppipe.slurm.call_executor)."""
    plugin = workflow.executor_plugin
    if plugin is not None:
        return plugin.name == "slurm"
    return ddp_call_executor.executor_of_call(sys.argv) == "slurm"


# The image check of every run, once per device decision and container section (a sweep's
# trials share theirs).
GPU_IMAGE_CHECK = ddp_gpu_check.GpuImageCheck()


def run_gpus(run):
    """ "yes" when the run ``run`` trains on GPUs (its spec), else "no"; a GPU run's image must
    have CUDA (ddppipe.apptainer.gpu_check), a config error otherwise."""
    spec = RUNS.spec(run)
    try:
        GPU_IMAGE_CHECK(spec, image_recipe())
    except ddp_apptainer.ContainerError as e:
        raise WorkflowError(str(e)) from None
    return "yes" if spec.gpus else "no"


def print_summary():
    """The run's summary (ddppipe.reports.summary) at the end of every snakemake call."""
    from ddppipe.reports import summary as ddp_summary

    root = ddp_layout.RunLayout(RUN).root
    if root.is_dir():
        logger.info(ddp_summary.text(root))
    print_sweep()


def print_sweep():
    """With a sweep: its table and best trial written from what exists (a failed trial's row
    says why, even when rule sweep_table could not run), and its top trials printed."""
    if SWEEP is None:
        return
    from ddppipe.sweeps import results as ddp_sweep_results

    logger.info(ddp_sweep_results.after_call(SWEEP, ddp_layout.RESULTS))


def run_states():
    """The state folders of every run this workflow may train (the main run, the study's)."""
    return [ddp_state.StateDir(ddp_layout.RunLayout(r).state) for r in RUNS.names()]


def check_cluster_policy():
    """Before the SLURM executor submits anything: fail (or warn) on cluster settings that
    would hang the workflow or lose work (ddppipe.slurm.cluster_policy)."""
    if not on_slurm():
        return
    settings = workflow.executor_settings
    try:
        found = ddp_cluster_policy.check_cluster(
            RUNS.spec(RUN), settings.status_command, settings.requeue, run_states()
        )
    except ddp_cluster_policy.ClusterPolicyError as e:
        raise WorkflowError(str(e)) from None  # shown as a message, without a traceback
    for finding in found:
        logger.warning(f"ddppipe cluster check: {finding}")


def install_snakemake_changes():
    """ddppipe's changes to Snakemake's executor and scheduler, after a check of Snakemake's
    version and the SLURM plugin's (ddppipe.pipeline.snakemake_changes): the SLURM executor's
    extension, the zero-thread rules beside a training, a sweep's trials in order and
    --keep-going."""
    changes = ddp_snakemake_changes.Changes(
        on_slurm(),
        training_state,
        run_states(),
        trial_order if SWEEP is not None else None,
    )
    try:
        ddp_snakemake_changes.install(workflow, changes)
    except (
        ddp_snakemake_changes.SnakemakeVersionError,
        ddp_executor.PluginVersionError,
    ) as e:
        raise WorkflowError(str(e)) from None


def training_state(job):
    """The state folder of a train job's run (None for another rule's job)."""
    if job.name != "train":
        return None
    return ddp_state.StateDir(ddp_layout.RunLayout(job.wildcards_dict["run"]).state)


WARM_SERVER = []  # the warm-rank server of this call, when it started one


def start_warm_ranks():
    """A local call of a config with a sweep or a scaling study: one server imports torch once
    and forks every trial's ranks (ddppipe.launching.warm), instead of each rank importing it.
    Not on SLURM (the ranks run on the job's nodes), nor in a container (another Python).
    """
    if on_slurm() or ddp_apptainer.enabled(RUNS.spec(RUN).container):
        return
    if os.environ.get("SLURM_JOB_ID") or not trains_several():
        return  # (a job's own snakemake, or one training: no import to share)
    socket = ddp_warm.local_socket()
    server = ddp_warm.start(
        socket, ddp_layout.LOGS / "warm-server.log", warm_datasets()
    )
    WARM_SERVER.append(server)
    os.environ[ddp_env_names.WARM_SOCKET] = str(socket)
    os.environ[ddp_env_names.WARM_SERVER] = str(server.pid)


def warm_datasets(most=4):
    """The task datasets the warm server keeps for the ranks: each distinct prepared data
    folder and task_args of this call's runs (at most ``most``; a script run has none).
    """
    if KIND == "script":
        return []
    found = []
    for run in [
        *reversed(RUNS.names())
    ]:  # the trials first: a sweep's call trains them
        item = {  # its task_args as its spec has them (its preset's too)
            "task": config["task"],
            "data_dir": run_data(run),
            "args": ddp_run_spec.plain(RUNS.spec(run).task_args),
        }
        if item not in found:
            found.append(item)
    return found[:most]


def trains_several():
    """Whether this call trains more than one run (or suggests trials still to train)."""
    todo = [j.rule.name for j in workflow.dag.needrun_jobs()]
    return todo.count("train") + todo.count("train_packed") > 1 or "sweep_round" in todo


def stop_warm_ranks():
    for server in WARM_SERVER:
        server.terminate()
        server.wait()
    WARM_SERVER.clear()
    os.environ.pop(ddp_env_names.WARM_SOCKET, None)
    os.environ.pop(ddp_env_names.WARM_SERVER, None)


# The rules beside a training (`threads: 0`: evaluation, plots, the attempt page, export, the
# summary) take one of BESIDE_AT_ONCE slots: Snakemake's local executor runs each job in one of
# cores + 5 threads, and a zero-thread job past them waits in its queue, so a finished trial's
# plots would hold back the next trial's config and the round that suggests it.
BESIDE = "ddppipe_beside"
BESIDE_AT_ONCE = 3
workflow.register_resource(BESIDE, BESIDE_AT_ONCE)


# -- the Apptainer image (rule build_image, container.mode) --------------------------------

ROOT = (
    workflow.basedir
)  # the repository root: the recipes' %files paths are relative to it


def image_recipe():
    """The image's recipe (container.recipe), from the repository's root."""
    return os.path.join(ROOT, config["container"]["recipe"])


def image_sources():
    """What the image is built from: recipe, pyproject.toml, the torch pin, the sources."""
    src = os.path.join(ROOT, "src", "ddppipe")
    return {
        "recipe": image_recipe(),
        "pyproject": os.path.join(ROOT, "pyproject.toml"),
        "constraints": os.path.join(ROOT, "constraints.txt"),
        "sources": sorted(
            glob.glob(f"{src}/**/*.py", recursive=True)
            + glob.glob(f"{src}/**/*.yaml", recursive=True)
        ),
    }


def image_requirements():
    """container.requirements (sorted); an unpinned one is a config error."""
    try:
        return ddp_requirements.requirements(RUNS.spec(RUN).container)
    except ddp_apptainer.ContainerError as e:
        raise WorkflowError(str(e)) from None


# non-empty: rule build_task_image derives an image with them from container.image
TASK_REQUIREMENTS = image_requirements()


def run_image():
    """The image train and evaluate run in: container.image, or with container.requirements
    the one derived from it (rule build_task_image)."""
    return ddp_running.run_image(RUNS.spec(RUN).container)


def image_input():
    """The image (and its info) as inputs of the rules that run in it (train, and with
    task_exec() prepare_data and write_config): built first; none when mode is none."""
    if not ddp_apptainer.enabled(RUNS.spec(RUN).container):
        return []
    return [run_image(), str(ddp_identity.info_path(run_image()))]


def image_exec():
    """Shell prefix running a rule's command inside the image ('' when mode is none)."""
    return (
        shlex.join(ddp_running.exec_prefix(RUNS.spec(RUN))) + " "
        if ddp_apptainer.enabled(RUNS.spec(RUN).container)
        else ""
    )


def task_exec():
    """Shell prefix of a rule that imports the task (its prepare(), the check of task_args and
    model()): with container.mode apptainer, `apptainer exec ... IMAGE ` of the image the run
    trains in, so the host needs none of the task's packages; '' without a container, and in
    a script run (write_config only hashes a script). Part of the rule's text, so a run
    without a container keeps its commands, and re-runs nothing."""
    if KIND == "script":
        return ""
    return image_exec().replace("{", "{{").replace("}", "}}")


def image_info_arg():
    """`ddppipe export` option recording the image (the one training ran in) in the provenance."""
    if not ddp_apptainer.enabled(RUNS.spec(RUN).container):
        return ""
    return f"--image-info {ddp_identity.info_path(run_image())}"


# A GPU run (container.mode apptainer) needs an image with CUDA: a config error, before any
# job (each trial's too, at its write_config). Judged on the base image and its recipe: a
# derived image keeps their torch and CUDA.
run_gpus(RUN)


# -- a sweep (config sweep:, rules/sweep.smk) ------------------------------------------

SWEEP = RUNS.sweep
# The train rule's resource that holds a trial's slot: at most sweep.max_parallel trials train
# (on SLURM: are queued or running) at once, and the next starts when one ends.
SWEEP_SLOT = "ddppipe_sweep_trials"

if SWEEP is not None:
    try:
        ddp_sweep.check_definition(SWEEP)  # one name, one sweep: never two in one table
        ddp_sweep.check_metric(SWEEP, None if KIND == "script" else SOURCE.path)
    except ddp_config.ConfigError as e:
        raise WorkflowError(str(e)) from None
    workflow.register_resource(SWEEP_SLOT, ddp_allocation.trials_at_once(SWEEP))
    if SWEEP.method == "tpe":
        logger.info(ddp_sweep.rounds_note(SWEEP))


# sweep.pack: the trials are trained by train_packed (rules/train.smk), a job of this Snakemake;
# on SLURM it queues the trial for the sweep's held allocations (ddppipe.packing); locally it
# trains as rule train would. (Which executor runs is known once the DAG is built, not here.)
PACKED = SWEEP is not None and SWEEP.pack is not None
PACKED_PREFIX = re.escape(ddp_sweep.run_name(SWEEP.name, "")) if PACKED else None
PACKED_RUN = f"{PACKED_PREFIX}[^/]+" if PACKED else ".+"
UNPACKED_RUN = (
    f"(?!{PACKED_PREFIX}).+" if PACKED else ".+"
)  # (a trial's name has no slash)
if (
    PACKED and RUNS.trials
):  # (a tpe sweep's first trial is checked when it is suggested)
    try:
        ddp_allocation.Allocation.of(RUNS.spec(RUNS.trials[0].run))
    except ddp_allocation.PackError as e:
        raise WorkflowError(str(e)) from None


def packed_prefix(run):
    """On SLURM, the command a packed trial's launch runs under: `ddppipe pack-trial` (it
    queues the launch for the sweep's allocations and waits); '' otherwise."""
    if not (PACKED and on_slurm() and re.fullmatch(PACKED_RUN, run)):
        return ""
    layout = ddp_layout.RunLayout(run)
    return (
        f"ddppipe pack-trial --pool {shlex.quote(str(SWEEP.layout.pack))}"
        f" --config {shlex.quote(str(layout.config))} --order {trial_place(run)} -- "
    )


def close_pack():
    """At the end of the call: the packed sweep's idle allocations end at once."""
    if PACKED:
        ddp_pool.Pool(SWEEP.layout.pack).close()


def packed_threads(run):
    """A packed trial's cores on this machine: none on SLURM (it waits), else its training's."""
    return 0 if on_slurm() else ddp_launch.job_threads(RUNS.spec(run))


def sweep_layout():
    """The config's sweep's folder; a clear error when the config has no sweep."""
    if SWEEP is None:
        raise WorkflowError(
            "no sweep in this config: set sweep.name and sweep.parameters, e.g. --config "
            "'sweep={name: lr, parameters: {train.lr: [0.01, 0.1]}}' (docs/sweeps.md)"
        )
    return SWEEP.layout


def sweep_trial_runs():
    """The runs of the sweep's trials: a model-based sweep's once all its rounds are suggested
    (before that, the next round's checkpoint: Snakemake asks again once it has run)."""
    if SWEEP is not None and SWEEP.method == "tpe":
        return rounds_trial_runs(len(ddp_sweep.round_sizes(SWEEP)))
    return [t.run for t in RUNS.trials]


def sweep_targets(wildcards):
    """Rule sweep's input: the table, best trial and figures, and the outputs of every trial
    known now; while a model-based sweep has a round to suggest, that round's file too, so
    each trial trains (and is evaluated) as soon as its round is suggested, next to the
    trials before it, not once every round is."""
    layout = sweep_layout()
    k = ddp_sweep.unsuggested_round(SWEEP) if SWEEP.method == "tpe" else None
    if k is None:
        runs, next_round = sweep_trial_runs(), []
    else:
        runs, next_round = rounds_trial_runs(k), [ddp_sweep.round_file(SWEEP, k)]
    targets = [t for run in runs for t in ddp_layout.RunLayout(run).targets(KIND)]
    return [
        str(p)
        for p in (
            layout.trials_csv,
            layout.best,
            layout.overview,
            *next_round,
            *targets,
        )
    ]


def rounds_trial_runs(upto):
    """The runs of the trials of a model-based sweep's rounds before round ``upto``; raise
    Snakemake's IncompleteCheckpointException for the first round not suggested yet."""
    for k in range(upto):
        checkpoints.sweep_round.get(sweep=SWEEP.name, round=str(k))
    RUNS.refresh()
    return [t.run for t in ddp_sweep.trials(SWEEP, upto=upto)]


def finished_rounds(wildcards):
    """Round k's input: round k - 1's file (its job then waits inside for a free slot,
    ddppipe.sweeps.slots); a sweep suggested in whole rounds: every trial before it,
    evaluated."""
    k = int(wildcards.round)
    if ddp_sweep.whole_rounds(SWEEP):
        return [
            str(ddp_layout.RunLayout(run).eval.metrics) for run in rounds_trial_runs(k)
        ]
    return [str(ddp_sweep.round_file(SWEEP, k - 1))] if k else []


def all_rounds(wildcards):
    """A model-based sweep's round files, once every round is suggested; none otherwise."""
    if SWEEP is None or SWEEP.method != "tpe":
        return []
    sizes = ddp_sweep.round_sizes(SWEEP)
    rounds_trial_runs(len(sizes))
    return [str(ddp_sweep.round_file(SWEEP, k)) for k in range(len(sizes))]


def trial_slot(wildcards):
    """1 for a sweep's trial (it holds one of max_parallel slots), 0 for any other run."""
    return int(
        SWEEP is not None
        and wildcards.run.startswith(ddp_sweep.run_name(SWEEP.name, ""))
    )


def trial_place(run):
    """The place of the sweep's trial ``run`` (0: the first; a grid's values in their order,
    the first key varying slowest, random and tpe trials in the order drawn); None for a run
    that is no trial of the sweep."""
    return RUNS.place(run)


def trial_priority(wildcards):
    """Rule train's priority: a trial's, the earlier in the sweep the higher (Snakemake
    starts the ready jobs of the highest first); 0 for any other run."""
    place = trial_place(wildcards.run)
    if place is None:
        return 0
    return ddp_in_order.priority(place, max(len(RUNS.trials), SWEEP.trials))


def trial_order(job):
    """A trial's training job: its place in the sweep; None for any other job."""
    if job.name not in ("train", "train_packed"):
        return None
    return trial_place(job.wildcards_dict["run"])


def trial_files(path):
    """``path`` (a function of a trial's RunLayout) of every trial known now."""
    return lambda wildcards: [
        str(path(ddp_layout.RunLayout(run))) for run in sweep_trial_runs()
    ]
