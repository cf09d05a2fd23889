"""The container: running inside an image (``running``, ``binds``), its identity (``identity``),
building it (``building``), a task's derived image (``requirements``, ``task_recipe``,
``task_image``), the GPU-image check (``gpu_check``); ``tool`` holds the program's name and
error. The image subcommands are in ``ddppipe.cli.commands.apptainer``."""
