"""Sweeps: a sweep's trials as ordinary runs, ranked (its table, best trial, figures) and, for
a model-based method, suggested in rounds. The definition and trials: :mod:`ddppipe.settings.sweep`;
a trial's pruning at epoch ends: :mod:`ddppipe.training.loop.pruning`."""
