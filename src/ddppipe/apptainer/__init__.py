"""The container: running inside an image (``running``, ``binds``), its identity (``identity``),
building it (``building``), a task's packages as a layer over it (``requirements``, ``layer``),
the GPU-image check (``gpu_check``); ``tool`` holds the program's name and error. The image
subcommands are in ``ddppipe.cli.commands.apptainer``."""
