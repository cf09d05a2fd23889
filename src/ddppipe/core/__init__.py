"""Helpers every layer may use: atomic writes, errors, hashing, JSON lines, the heap, hosts and
ports of a SLURM job, this machine's CPUs and git commit."""
