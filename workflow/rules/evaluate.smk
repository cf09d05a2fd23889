if KIND == "script":

    rule evaluate:
        """A script run's evaluation: the last value of everything it logged (job.log)."""
        input:
            RUN_LAYOUT.train.metrics,
        output:
            metrics=report(
                RUN_LAYOUT.eval.metrics,
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
            plot=report(
                RUN_LAYOUT.eval.plot(KIND),
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
        log:
            RUN_LAYOUT.log("evaluate"),
        benchmark:
            RUN_LAYOUT.benchmark("evaluate")
        localrule: True
        threads: 0  # no core of its own: a little Python beside a training
        resources:
            ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
        shell:
            "ddppipe evaluate-logged --metrics {input} --out {output.metrics}"
            " --plot {output.plot} 2> {log}"

else:

    rule evaluate:
        """The final model's test-set metrics and confusion matrix.

        The training evaluated it on its own ranks and devices (train/evaluation.json), so
        this rule only presents them: local, no torch, no compute node to wait for (README,
        "SLURM"). `ddppipe evaluate` re-evaluates a checkpoint by hand.
        """
        input:
            RUN_LAYOUT.train.evaluation,
        output:
            metrics=report(
                RUN_LAYOUT.eval.metrics,
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
            plot=report(
                RUN_LAYOUT.eval.plot(KIND),
                caption="../report/confusion_matrix.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
        log:
            RUN_LAYOUT.log("evaluate"),
        benchmark:
            RUN_LAYOUT.benchmark("evaluate")
        localrule: True
        threads: 0  # no core of its own: a little Python beside a training
        resources:
            ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
        shell:
            "ddppipe plot-evaluation --evaluation {input} --metrics {output.metrics}"
            " --plot {output.plot} 2> {log}"


rule plot_training:
    """Per-epoch loss and accuracy curves."""
    input:
        RUN_LAYOUT.train.metrics,
    output:
        report(
            RUN_LAYOUT.train.curves,
            caption="../report/training_curves.rst",
            category="Training",
            subcategory="{run}",
        ),
    log:
        RUN_LAYOUT.log("plot_training"),
    localrule: True
    threads: 0  # no core of its own: a little Python beside a training
    resources:
        ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
    shell:
        "ddppipe plot-training --metrics {input} --out {output} 2> {log}"


rule attempt_history:
    """Every job slot that trained the run: job, nodes, times, how it ended, steps trained."""
    input:
        RUN_LAYOUT.train.attempts,
    output:
        report(
            RUN_LAYOUT.train.attempts_html,
            caption="../report/attempts.rst",
            category="Training",
            subcategory="{run}",
        ),
    log:
        RUN_LAYOUT.log("attempt_history"),
    localrule: True
    threads: 0  # no core of its own: a little Python beside a training
    resources:
        ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
    shell:
        "ddppipe attempts --history {input} --run {wildcards.run} --html {output} 2> {log}"


rule export:
    """The result (a task's final weights, a script's output files) and its provenance
    (code, task or script, software, hosts, seed, data, attempts).

    The training wrote the final weights and its record (train/model.pt, train/final.json)
    next to its final checkpoint, so this rule copies and hashes files: it imports no torch.
    """
    input:
        # the training's result as export publishes it: a task's weights alone
        result=(
            RUN_LAYOUT.train.outputs if KIND == "script" else RUN_LAYOUT.train.weights
        ),
        record=P.task_only(RUN_LAYOUT.train.record),
        config=RUN_LAYOUT.config,
        attempts=RUN_LAYOUT.train.attempts,
        data=P.data_input(),
        image=IMAGE.as_input(),
    output:
        result=P.result_output(RUN_LAYOUT.export.result(KIND)),
        provenance=report(
            RUN_LAYOUT.export.provenance,
            caption="../report/provenance.rst",
            category="Provenance",
            subcategory="{run}",
        ),
    log:
        RUN_LAYOUT.log("export"),
    benchmark:
        RUN_LAYOUT.benchmark("export")
    localrule: True  # copies and hashes files: no compute node to wait for
    threads: 0  # no core of its own: a little Python beside a training
    resources:
        ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
    params:
        data=P.data_option,
        image_info=IMAGE.info_arg(),  # records the image's SHA-256 in the provenance
        record=lambda wc, input: f"--record {input.record}" if input.record else "",
    shell:
        "ddppipe export --result {input.result} {params.record} --config {input.config}"
        " {params.data}"
        " --out {output.result} --provenance {output.provenance} {params.image_info}"
        " --attempts {input.attempts}"
        " 2> {log}"


rule summarize:
    """The run's summary (ddppipe.reports.summary) as HTML: the first thing the report shows."""
    input:
        config=RUN_LAYOUT.config,
        metrics=RUN_LAYOUT.train.metrics,
        attempts=RUN_LAYOUT.train.attempts,
        result=rules.export.output.result,
        provenance=rules.export.output.provenance,
    output:
        report(
            RUN_LAYOUT.summary,
            caption="../report/summary.rst",
            category="Summary",
            subcategory="{run}",
        ),
    log:
        RUN_LAYOUT.log("summarize"),
    localrule: True
    threads: 0  # no core of its own: a little Python beside a training
    resources:
        ddppipe_beside=1,  # (ddppipe.pipeline.pipeline.BESIDE)
    shell:
        "ddppipe summary {wildcards.run} --html {output} 2> {log}"
