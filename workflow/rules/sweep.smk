# A sweep (config sweep:, ddppipe.spec.sweep): one run per trial, named sweeps/<sweep>/<trial>
# and trained by the same rules as the base run, then ranked in one table with its figures.
# Run it with `snakemake --cores all sweep` (on SLURM: --profile profiles/slurm sweep).


rule sweep:
    """Target: the sweep's table, best trial and figures, and every trial's run outputs."""
    input:
        lambda wc: [
            sweep_layout().trials_csv,
            sweep_layout().best,
            *[
                str(target)
                for run in sweep_trial_runs()
                for target in ddp_layout.RunLayout(run).targets(KIND)
            ],
        ],


rule sweep_trials:
    """The sweep's definition and its trials (name, run, values): what the table lists."""
    output:
        "results/sweeps/{sweep}/sweep.json",
    log:
        "logs/sweeps/{sweep}/sweep_trials.log",
    localrule: True
    params:
        config=json.dumps(config),
    shell:
        "ddppipe sweep-trials --config-json {params.config:q} --out {output} 2> {log}"


rule sweep_table:
    """One row per trial (outcome, values, metric, cost) and the best trial.

    Also written by every snakemake call's end (onsuccess/onerror), with the trials that
    failed or have not run yet, and its top rows printed (ddppipe.sweeps.table).
    """
    input:
        sweep="results/sweeps/{sweep}/sweep.json",
        evaluations=trial_files(lambda r: r.eval.metrics),
        metrics=trial_files(lambda r: r.train.metrics),
        attempts=trial_files(lambda r: r.train.attempts),
    output:
        table=report(
            "results/sweeps/{sweep}/trials.csv",
            caption="../report/sweep_table.rst",
            category="Sweep",
        ),
        best=report(
            "results/sweeps/{sweep}/best.json",
            caption="../report/sweep_best.rst",
            category="Sweep",
        ),
    log:
        "logs/sweeps/{sweep}/sweep_table.log",
    localrule: True
    shell:
        "ddppipe sweep-table --sweep {input.sweep} --csv {output.table}"
        " --best {output.best} 2> {log}"
