# ddppipe: download MNIST -> DDP training with torchrun -> evaluation -> export -> report.
from snakemake.utils import min_version, validate

from ddppipe.config import validate as ddp_validate

min_version("9.0")


configfile: "config/config.yaml"


# `--config` values arrive as text ('launch={nnodes: 2}' gives "2"): coerced to the schema's
# types first, with a clear error naming each key that cannot be; then the standard check.
ddp_validate(config)
validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/container.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/scaling.smk"


onstart:
    check_cluster_policy()  # SLURM executor: settings that would hang or lose work


rule all:
    input:
        all_outputs(),
    default_target: True
