rule train:
    """Multi-process DDP training, started by torchrun; resumes from the run's checkpoints.

    In a SLURM job the training is an srun step; a stop on the time-limit warning requeues
    the job (same id, next slot) until training completes (ddppipe.lifecycle). Snakemake
    deletes a job's log when the job (a slot) starts, so the launcher appends to the run's
    state/train.log (live, every slot) and the log is its copy when the slot ends.
    """
    input:
        config="results/{run}/config.yaml",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
        image=image_input(),  # container.mode apptainer: launch runs torchrun in the image
    output:
        checkpoint="results/{run}/train/final.pt",
        metrics="results/{run}/train/metrics.jsonl",
        attempts="results/{run}/train/attempts.json",  # every job slot that trained the run
    log:
        "logs/{run}/train.log",
    benchmark:
        "benchmarks/{run}/train.tsv"
    threads: lambda wc: ddp_launch.job_threads(ddp_scaling.config_for_run(config, wc.run))
    resources:
        **ddp_slurm.train_resources(config),  # ddppipe.slurm.Request, per run
    params:
        data=data_folder,  # the folder of input.data
        state="results/{run}/state",
    shell:
        "mkdir -p {params.state}; status=0;"
        " ddppipe launch --config {input.config} --data {params.data} --state {params.state}"
        " --checkpoint {output.checkpoint} --metrics {output.metrics}"
        " --attempts {output.attempts} 2>> {params.state}/train.log || status=$?;"
        " cp {params.state}/train.log {log}; exit $status"
