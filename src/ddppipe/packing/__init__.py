"""A sweep's trials packed into a few held SLURM allocations (``sweep.pack``).

Each allocation is one SLURM job whose nodes run ``ddppipe pack-worker``: every node's slots
take the next trial from the sweep's queue as soon as one ends, its ranks forked warm
(:mod:`ddppipe.launching.warm`). A trial is still an ordinary run: the train rule of a packed
trial (a local job of the submitting Snakemake) puts the trial's launch command in the queue,
makes sure an allocation holds or is coming, and waits for the trial's exit status.
"""
