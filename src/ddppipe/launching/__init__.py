"""Starting a training: local process groups, torchrun/srun, the slot's life cycle, preflight."""
