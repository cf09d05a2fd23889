rule train:
    """Multi-process DDP training, started by torchrun; resumes from the run's checkpoints."""
    input:
        config="results/{run}/config.yaml",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
        image=image_input(),  # container.mode apptainer: launch runs torchrun in the image
    output:
        checkpoint="results/{run}/train/final.pt",
        metrics="results/{run}/train/metrics.jsonl",
    params:
        state="results/{run}/state",
    log:
        "logs/{run}/train.log",
    benchmark:
        "benchmarks/{run}/train.tsv"
    threads: lambda wc: ddp_launch.job_threads(ddp_scaling.config_for_run(config, wc.run))
    resources:
        **ddp_slurm.train_resources(config),  # per run: a scaling point's own nodes and CPUs
    shell:
        "ddppipe launch --config {input.config} --data {DATA} --state {params.state}"
        " --checkpoint {output.checkpoint} --metrics {output.metrics} 2> {log}"
