# A sweep (config sweep:, ddppipe.settings.sweep): one run per trial, named sweeps/<sweep>/<trial>
# and trained by the same rules as the base run, then ranked in one table with its figures.
# Run it with `snakemake --cores all sweep` (on SLURM: --profile profiles/slurm sweep).


rule sweep:
    """Target: the sweep's table, best trial and figures, and every trial's run outputs."""
    input:
        SWEEP.targets,


rule sweep_trials:
    """The sweep's definition and its trials (name, run, values): what the table lists."""
    input:
        rounds=SWEEP.all_rounds,  # a model-based sweep: once every round is suggested
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
        evaluations=SWEEP.trial_files(lambda r: r.eval.metrics),
        metrics=SWEEP.trial_files(lambda r: r.train.metrics),
        attempts=SWEEP.trial_files(lambda r: r.train.attempts),
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
        " --best {output.best} > {log} 2>&1"


rule plot_sweep:
    """The metric against each parameter, every trial's learning curve, a parallel-coordinates
    view, and the report's first screen (the top trials and these figures)."""
    input:
        sweep="results/sweeps/{sweep}/sweep.json",
        table="results/sweeps/{sweep}/trials.csv",
    output:
        metric=report(
            "results/sweeps/{sweep}/figures/metric_vs_parameters.png",
            caption="../report/sweep_metric.rst",
            category="Sweep",
        ),
        curves=report(
            "results/sweeps/{sweep}/figures/learning_curves.png",
            caption="../report/sweep_curves.rst",
            category="Sweep",
        ),
        parallel=report(
            "results/sweeps/{sweep}/figures/parallel_coordinates.png",
            caption="../report/sweep_parallel.rst",
            category="Sweep",
        ),
        overview=report(
            "results/sweeps/{sweep}/figures/overview.html",
            caption="../report/sweep_overview.rst",
            category="Sweep",
        ),
    log:
        "logs/sweeps/{sweep}/plot_sweep.log",
    localrule: True
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.overview),
    shell:
        "ddppipe plot-sweep --sweep {input.sweep} --out-dir {params.out_dir} 2> {log}"


checkpoint sweep_round:
    """A model-based sweep's round: its trials, suggested by Optuna's TPE sampler from the
    finished trials before it, once a slot is free (ddppipe.sweeps.rounds: the job waits for
    one, beside the trainings)."""
    input:
        SWEEP.finished_rounds,
    output:
        "results/sweeps/{sweep}/rounds/{round}.json",
    log:
        "logs/sweeps/{sweep}/sweep_round_{round}.log",
    wildcard_constraints:
        round=r"\d+",
    localrule: True
    threads: 0  # no core of its own: it waits beside the trainings
    params:
        config=json.dumps(config),
    shell:
        "ddppipe sweep-round --config-json {params.config:q} --round {wildcards.round}"
        " --out {output} 2> {log}"
