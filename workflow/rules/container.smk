# The Apptainer image that train and evaluate run in when config container.mode is apptainer.
rule build_image:
    """Build the Apptainer image (atomically) and its info JSON (SHA-256, recipe, labels).

    Rebuilt when the recipe, pyproject.toml or a source file of the package changes.
    """
    input:
        **IMAGE.sources(),
    output:
        image=config["container"]["image"],
        info=IMAGE.info(config["container"]["image"]),
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


if P.task_requirements:

    rule build_task_layer:
        """The task's pinned pip packages (container.requirements) installed over the image
        into a small SquashFS layer, atomically, with its info JSON (SHA-256, requirements,
        what it installed, the base image's SHA-256).

        Named by a hash of the list: a changed list is a new layer (the image is not rebuilt);
        a rebuilt image re-layers it. Train and evaluate bind it over the image
        (IMAGE.task_layer()).
        """
        input:
            image=config["container"]["image"],
            info=IMAGE.info(config["container"]["image"]),
        output:
            layer=IMAGE.task_layer(),
            info=IMAGE.info(IMAGE.task_layer()),
        log:
            "logs/build_task_layer.log",
        benchmark:
            "benchmarks/build_task_layer.tsv"
        localrule: True
        params:
            requirements=shlex.join(P.task_requirements),
        shell:
            "ddppipe build-task-layer --base {input.image} --layer {output.layer}"
            " --info {output.info} --log {log} {params.requirements}"
