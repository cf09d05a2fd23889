# The Apptainer image that train and evaluate run in when config container.mode is apptainer.
rule build_image:
    """Build the Apptainer image (atomically) and its info JSON (SHA-256, recipe, labels).

    Rebuilt when the recipe, pyproject.toml or a source file of the package changes.
    """
    input:
        **image_sources(),
    output:
        image=config["container"]["image"],
        info=str(ddp_container.info_path(config["container"]["image"])),
    log:
        "logs/build_image.log",
    benchmark:
        "benchmarks/build_image.tsv"
    localrule: True
    params:
        # the repository root (pyproject.toml's folder): %files paths are relative to it
        context=lambda wildcards, input: os.path.dirname(input.pyproject),
    shell:
        "ddppipe build-image --recipe {input.recipe} --image {output.image}"
        " --info {output.info} --log {log} --context {params.context}"
