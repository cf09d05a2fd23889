"""A user's own torchrun script (``script:`` in the config) on the ranks: the job API it calls
(``from ddppipe import job``), and the entry point that runs it and records its failure.
"""
