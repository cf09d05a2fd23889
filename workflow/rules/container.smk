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

    rule build_task_image:
        """The image plus the task's pinned pip packages (container.requirements), atomically,
        with its recipe and info JSON (SHA-256, labels, requirements, base image).

        Named by a hash of the list: a changed list is a new image; a rebuilt base image
        rebuilds it. Train and evaluate then run in it (IMAGE.run_image()).
        """
        input:
            image=config["container"]["image"],
            info=IMAGE.info(config["container"]["image"]),
        output:
            image=IMAGE.run_image(),
            info=IMAGE.info(IMAGE.run_image()),
            recipe=IMAGE.task_image_recipe(),
        log:
            "logs/build_task_image.log",
        benchmark:
            "benchmarks/build_task_image.tsv"
        localrule: True
        params:
            requirements=shlex.join(P.task_requirements),
        shell:
            "ddppipe build-task-image --base {input.image} --image {output.image}"
            " --info {output.info} --log {log} {params.requirements}"
