"""SLURM: the resource request, accounting, continuations, cluster policy, status checks."""
