"""``ddppipe reproduce``: rebuild a finished run from what it wrote, and say whether it came
out the same.

:mod:`.source` finds a run's record (its folder, provenance, metrics, weights), :mod:`.checks`
checks what can be checked before training (code, data, task, packages, image, device),
:mod:`.plan` writes the reproduction's config, :mod:`.rerun` trains and exports it in a new run
folder, :mod:`.compare` compares weights, epochs and evaluation, :mod:`.causes` names why they
differ, :mod:`.verdict` words the one line; :mod:`.command` runs them in that order.
"""
