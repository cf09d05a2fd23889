"""A task's training loop on the ranks: the trainer and how its ranks hold the model (its
strategy), evaluation, the optimizer and schedule, what the ranks agree on every few steps,
their random streams and deterministic kernels, the checkpoints as the loop takes them, the
probes of a step's all-reduce and FLOPs, a sweep trial's pruning, and the files a training
reads and writes; and the environment's one-step check.
"""
