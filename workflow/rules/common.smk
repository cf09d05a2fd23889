# The workflow's one object (ddppipe.pipeline.pipeline.Pipeline): the runs, the run layout,
# the task's data, the image and the sweep, each rule input, parameter and resource a method.
import json
import os
import shlex

from ddppipe.pipeline import call as ddp_call
from ddppipe.pipeline.pipeline import Pipeline

P = Pipeline(config, workflow, checkpoints)
RUNS = P.runs
KIND = P.kind  # a task (model + data, prepared by the data rule) or a torchrun script
RUN_LAYOUT = P.layout  # every path of a run, patterns of the {run} wildcard
IMAGE = P.images
SWEEP = P.sweep
