if SCRIPT:

    rule evaluate:
        """A script run's evaluation: the last value of everything it logged (job.log)."""
        input:
            "results/{run}/train/metrics.jsonl",
        output:
            metrics=report(
                "results/{run}/eval/metrics.json",
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
            plot=report(
                "results/{run}/eval/metrics.png",
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
        log:
            "logs/{run}/evaluate.log",
        benchmark:
            "benchmarks/{run}/evaluate.tsv"
        localrule: True
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
            "results/{run}/train/evaluation.json",
        output:
            metrics=report(
                "results/{run}/eval/metrics.json",
                caption="../report/eval_metrics.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
            plot=report(
                "results/{run}/eval/confusion_matrix.png",
                caption="../report/confusion_matrix.rst",
                category="Evaluation",
                subcategory="{run}",
            ),
        log:
            "logs/{run}/evaluate.log",
        benchmark:
            "benchmarks/{run}/evaluate.tsv"
        localrule: True
        shell:
            "ddppipe plot-evaluation --evaluation {input} --metrics {output.metrics}"
            " --plot {output.plot} 2> {log}"


rule plot_training:
    """Per-epoch loss and accuracy curves."""
    input:
        "results/{run}/train/metrics.jsonl",
    output:
        report(
            "results/{run}/train/training_curves.png",
            caption="../report/training_curves.rst",
            category="Training",
            subcategory="{run}",
        ),
    log:
        "logs/{run}/plot_training.log",
    localrule: True
    shell:
        "ddppipe plot-training --metrics {input} --out {output} 2> {log}"


rule attempt_history:
    """Every job slot that trained the run: job, nodes, times, how it ended, steps trained."""
    input:
        "results/{run}/train/attempts.json",
    output:
        report(
            "results/{run}/train/attempts.html",
            caption="../report/attempts.rst",
            category="Training",
            subcategory="{run}",
        ),
    log:
        "logs/{run}/attempt_history.log",
    localrule: True
    shell:
        "ddppipe attempts --history {input} --run {wildcards.run} --html {output} 2> {log}"


rule export:
    """The result (a task's final weights, a script's output files) and its provenance
    (code, task or script, software, hosts, seed, data, attempts).

    The training wrote the final weights and its record (train/model.pt, train/final.json)
    next to its final checkpoint, so this rule copies and hashes files: it imports no torch.
    """
    input:
        result=(
            "results/{run}/train/outputs" if SCRIPT else "results/{run}/train/model.pt"
        ),
        record=[] if SCRIPT else "results/{run}/train/final.json",
        config="results/{run}/config.yaml",
        attempts="results/{run}/train/attempts.json",
        data=data_input(),
        image=image_input(),
    output:
        result=(
            directory("results/{run}/export/outputs")
            if SCRIPT
            else "results/{run}/export/model.pt"
        ),
        provenance=report(
            "results/{run}/export/provenance.json",
            caption="../report/provenance.rst",
            category="Provenance",
            subcategory="{run}",
        ),
    log:
        "logs/{run}/export.log",
    benchmark:
        "benchmarks/{run}/export.tsv"
    localrule: True  # copies and hashes files: no compute node to wait for
    params:
        data=lambda wc, input: (
            f"--data {os.path.dirname(input.data)}" if input.data else ""
        ),
        image_info=image_info_arg(),  # records the image's SHA-256 in the provenance
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
        config="results/{run}/config.yaml",
        metrics="results/{run}/train/metrics.jsonl",
        attempts="results/{run}/train/attempts.json",
        result=rules.export.output.result,
        provenance=rules.export.output.provenance,
    output:
        report(
            "results/{run}/summary.html",
            caption="../report/summary.rst",
            category="Summary",
            subcategory="{run}",
        ),
    log:
        "logs/{run}/summarize.log",
    localrule: True
    shell:
        "ddppipe summary {wildcards.run} --html {output} 2> {log}"
