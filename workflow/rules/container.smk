# The Apptainer image that train and evaluate run in when config container.mode is apptainer.
import glob
import os

from ddppipe import container as ddp_container

ROOT = workflow.basedir  # the repository root: the recipes' %files paths are relative to it


def image_sources():
    """What the image is built from: recipe, pyproject.toml and the package's sources."""
    src = os.path.join(ROOT, "src", "ddppipe")
    return {
        "recipe": os.path.join(ROOT, config["container"]["recipe"]),
        "pyproject": os.path.join(ROOT, "pyproject.toml"),
        "sources": sorted(
            glob.glob(f"{src}/**/*.py", recursive=True) + glob.glob(f"{src}/*.yaml")
        ),
    }


def image_input():
    """The image (and its info) as inputs of the rules that run in it; none when mode is none."""
    if not ddp_container.enabled(config):
        return []
    image = config["container"]["image"]
    return [image, str(ddp_container.info_path(image))]


def image_exec():
    """Shell prefix running a rule's command inside the image ('' when mode is none)."""
    return " ".join(ddp_container.exec_prefix(config)) + " " if ddp_container.enabled(config) else ""


def image_info_arg():
    """`ddppipe export` option recording the image in the provenance."""
    if not ddp_container.enabled(config):
        return ""
    return f"--image-info {ddp_container.info_path(config['container']['image'])}"


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
    shell:
        "ddppipe build-image --recipe {input.recipe} --image {output.image}"
        " --info {output.info} --log {log} --context {ROOT}"
