rule write_config:
    """The run's validated config with its preset filled in: what every later step reads.

    The base run gets the config as given; a scaling-study run (scaling-n<N>-p<P>-c<C>) gets
    it with that grid point's launch settings (ddppipe.scaling).
    """
    output:
        "results/{run}/config.yaml",
    log:
        "logs/{run}/write_config.log",
    localrule: True
    params:
        config=lambda wc: ddp_scaling.config_for_run(config, wc.run),
    run:
        from ddppipe import config as ddp_config

        ddp_config.write(ddp_config.resolve(params.config), output[0])


rule data_config:
    """The data settings alone: the dataset depends on them and on nothing of any run."""
    output:
        f"{DATA}.yaml",
    log:
        "logs/data_config.log",
    localrule: True
    params:
        data=config["data"],
    run:
        from ddppipe import config as ddp_config

        ddp_config.write({"data": params.data}, output[0])


rule download_mnist:
    """Download the four MNIST IDX files from the first working mirror and verify them."""
    input:
        settings=f"{DATA}.yaml",
    output:
        expand(f"{DATA}/{{name}}", name=MNIST_FILES),
    log:
        "logs/download_mnist.log",
    benchmark:
        "benchmarks/download_mnist.tsv"
    localrule: True
    params:
        data=lambda wildcards, output: os.path.dirname(output[0]),
    shell:
        "ddppipe download --config {input.settings} --dest {params.data} 2> {log}"
