rule train:
    """Multi-process DDP training, started by torchrun; resumes from the run's checkpoints.

    In a SLURM job the training is an srun step; a stop on the time-limit warning requeues
    the job (same id, next slot) until training completes (ddppipe.launching.lifecycle). Snakemake
    deletes a job's log when the job (a slot) starts, so the launcher appends to the run's
    state/train.log (live, every slot) and the log is its copy when the slot ends.
    """
    input:
        config=RUN_LAYOUT.config,
        data=P.data_input(),  # the task's data manifest (none for a script)
        image=IMAGE.as_input(),  # container.mode apptainer: launch runs torchrun in the image
    output:
        # a task's final checkpoint, or the files a script left in job.output_dir()
        result=P.result_output(RUN_LAYOUT.train.result(KIND)),
        metrics=RUN_LAYOUT.train.metrics,
        # a task's final evaluation (distributed, in the training's allocation); none for a script
        evaluation=P.task_only(RUN_LAYOUT.train.evaluation),
        # a task's final weights alone and the final checkpoint's record (for export)
        weights=P.task_only(RUN_LAYOUT.train.weights),
        record=P.task_only(RUN_LAYOUT.train.record),
        attempts=RUN_LAYOUT.train.attempts,  # every job slot that trained the run
    log:
        RUN_LAYOUT.log("train"),
    benchmark:
        RUN_LAYOUT.benchmark("train")
    wildcard_constraints:
        run=SWEEP.unpacked_run,  # a packed sweep's trials: rule train_packed
    # a sweep's trials start in its order (ddppipe.pipeline.in_order)
    priority: SWEEP.priority
    threads: P.threads
    resources:
        **P.train_resources(),  # ddppipe.slurm.request.Request, per run
        # a sweep's trial holds one of sweep.max_parallel slots (rules/sweep.smk)
        ddppipe_sweep_trials=SWEEP.trial_slot,
    params:
        data=P.data_option,
        state=str(RUN_LAYOUT.state),
        # what output.result is
        result="--outputs" if KIND == "script" else "--checkpoint",
        # a packed sweep's trial: its launch queued for the sweep's allocations (train_packed)
        pack=lambda wc: SWEEP.packed_prefix(wc.run, P.on_slurm()),
    shell:
        "{params.pack}ddppipe launch --config {input.config} {params.data} --state {params.state}"
        " {params.result} {output.result} --metrics {output.metrics}"
        " --attempts {output.attempts} --log {log}"


if SWEEP.packed:

    use rule train as train_packed with:
        wildcard_constraints:
            run=SWEEP.packed_run,
        # sweep.pack on SLURM: the trial trains in one of the sweep's held allocations
        # (ddppipe.packing); this job, local to the submitting Snakemake, queues its launch
        # command, keeps an allocation coming while trials wait, and waits for its status.
        # Locally it trains as rule train does.
        threads: lambda wc: SWEEP.packed_threads(wc.run, P.on_slurm())

    localrules:
        train_packed,
