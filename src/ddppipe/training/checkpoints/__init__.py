"""A run's checkpoints on disk: whole snapshots in one file (the final checkpoint, and the
``ckpt-*.pt`` of runs started before sharded checkpoints), sharded checkpoints written by every
rank in the background, and the checkpoint folder both keep the same way.
"""
