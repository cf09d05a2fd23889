"""What runs on the ranks: the training loop, evaluation, checkpoints, metrics, provenance."""
