# The scaling study (config scaling:, ddppipe.settings.scaling): a grid sweep named `scaling` over
# launch.nnodes, launch.nproc_per_node and launch.cpus_per_proc; each trial an ordinary run
# sweeps/scaling/<trial> trained by the same rules as the base run, then one plot rule.
# Run it with `snakemake --cores all scaling`.

SCALING_RUNS = RUNS.scaling_runs()
SCALING = str(RUNS.scaling.layout.root)  # results/sweeps/scaling


rule scaling:
    """Target: the study's figures and time-to-accuracy table, each trial's provenance and summary."""
    input:
        f"{SCALING}/learning_curves.png",
        f"{SCALING}/throughput.png",
        f"{SCALING}/time_to_accuracy.csv",
        f"{SCALING}/time_to_accuracy.html",
        expand(RUN_LAYOUT.export.provenance, run=SCALING_RUNS),
        expand(RUN_LAYOUT.summary, run=SCALING_RUNS),


rule plot_scaling:
    """Learning curves per trial, throughput and scaling efficiency, time to accuracy."""
    input:
        metrics=expand(RUN_LAYOUT.train.metrics, run=SCALING_RUNS),
        configs=expand(RUN_LAYOUT.config, run=SCALING_RUNS),
    output:
        curves=report(
            f"{SCALING}/learning_curves.png",
            caption="../report/scaling_curves.rst",
            category="Scaling study",
        ),
        throughput=report(
            f"{SCALING}/throughput.png",
            caption="../report/scaling_throughput.rst",
            category="Scaling study",
        ),
        table_csv=report(
            f"{SCALING}/time_to_accuracy.csv",
            caption="../report/scaling_table.rst",
            category="Scaling study",
        ),
        table_html=report(
            f"{SCALING}/time_to_accuracy.html",
            caption="../report/scaling_table.rst",
            category="Scaling study",
        ),
    log:
        f"logs/sweeps/{RUNS.scaling.name}/plot_scaling.log",
    localrule: True
    params:
        targets=config["scaling"]["accuracy_targets"],
    shell:
        "ddppipe plot-scaling --metrics {input.metrics} --configs {input.configs}"
        " --targets {params.targets} --curves {output.curves}"
        " --throughput {output.throughput} --table-csv {output.table_csv}"
        " --table-html {output.table_html} 2> {log}"
