rule write_config:
    """The run's validated config with its preset filled in: what every later step reads.

    The base run gets the config as given; a sweep's trial (the scaling study's too) gets it
    with the trial's values (ddppipe.settings.runs). A run that trains on GPUs
    gets its preset's GPU recipe (ddppipe.settings.presets): a change of device re-runs it.
    A task's task_args and model() are checked where it trains: with container.mode apptainer
    inside the run's image (a script is only hashed, on the host).
    """
    input:
        image=IMAGE.task_input(),
    output:
        RUN_LAYOUT.config,
    log:
        RUN_LAYOUT.log("write_config"),
    benchmark:
        RUN_LAYOUT.benchmark("write_config")
    localrule: True
    threads: 0  # no core of its own: the next trial's config is written beside a training
    params:
        config=lambda wc: json.dumps(RUNS.config(wc.run)),
        source=P.source.sha256,  # a changed task (or script) file re-runs the run's training
        gpus=lambda wc: P.run_gpus(wc.run),  # its device: decided once (RUNS.spec)
    # A shell command, not run: (Snakemake starts a run: job as a new snakemake process that
    # parses the workflow again, ~2.5 s); a broken task's error goes to the terminal too.
    # IMAGE.task_exec(): with container.mode apptainer, inside the image.
    shell:
        IMAGE.task_exec()
        + "ddppipe resolve-config --json {params.config:q} --gpus {params.gpus} --out {output}"
        " 2>&1 | tee {log} >&2"


rule data_config:
    """What the task's data depends on (task and task_args), and on nothing of any run."""
    output:
        "resources/{data}.yaml",
    log:
        "logs/data_config/{data}.log",
    wildcard_constraints:
        data=r"[^/]+",
    localrule: True
    params:
        settings=P.data_settings,
    shell:
        "ddppipe data-settings --json {params.settings:q} --out {output} 2> {log}"


rule prepare_data:
    """The task's prepare(): download, verify, convert, once; then the manifest of its files.

    Once per distinct set of the task_args values prepare() reads (ddppipe.settings.data_sets):
    a sweep of test_fraction prepares each trial's split. Runs on the submitting machine
    (localrule), which may be the only one with internet; with container.mode apptainer
    inside the image the run trains in (the task's packages are there).
    """
    input:
        settings="resources/{data}.yaml",
        image=IMAGE.task_input(),
    output:
        "resources/{data}/manifest.json",
    log:
        "logs/prepare_data/{data}.log",
    benchmark:
        "benchmarks/prepare_data/{data}.tsv"
    wildcard_constraints:
        data=r"[^/]+",
    localrule: True
    params:
        data=lambda wildcards, output: os.path.dirname(output[0]),
    # IMAGE.task_exec(): with container.mode apptainer, inside the image.
    shell:
        IMAGE.task_exec()
        + "ddppipe prepare --settings {input.settings} --dest {params.data} 2> {log}"
