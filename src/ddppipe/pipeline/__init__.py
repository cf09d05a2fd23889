"""The workflow's glue: what the Snakefile and its rules call that knows Snakemake's objects
(its scheduler and executor, changed in one declared place: :mod:`.snakemake_changes`)."""
