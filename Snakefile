# ddppipe: download MNIST -> DDP training with torchrun -> evaluation -> export -> report.
from snakemake.utils import min_version, validate

from ddppipe.settings.config import validate as ddp_validate

min_version("9.0")


configfile: "config/config.yaml"


# `--config` values arrive as text ('launch={nnodes: 2}' gives "2"): coerced to the schema's
# types first, with a clear error naming each key that cannot be; then the standard check.
ddp_validate(config)
validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


# Software: every rule runs the `ddppipe` command of this repository's environment (`make run`
# installs it), so no rule names a conda environment or container, the one `snakemake --lint`
# finding left (tests/test_lint.py allows only that one). The Apptainer image is ddppipe's own
# `container.mode`, not the `container:` directive: the train rule must call `srun` outside
# the image and start the image inside the step, on every node.


include: "workflow/rules/common.smk"
include: "workflow/rules/container.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/scaling.smk"
include: "workflow/rules/sweep.smk"


onstart:
    # SLURM: settings that would hang or lose work refused; every change to Snakemake's
    # objects, its version checked; local sweeps and studies: ranks forked warm
    ddp_call.start(P)


onsuccess:
    # the warm server left to the next call, a packed sweep's allocations ended, the summary
    ddp_call.end(P)


onerror:
    ddp_call.end(P)


rule all:
    default_target: True
    input:
        P.all_outputs(),
