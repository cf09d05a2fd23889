rule evaluate:
    """Test-set metrics of the final checkpoint and its confusion matrix."""
    input:
        checkpoint="results/{run}/train/final.pt",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
        image=image_input(),
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
    params:
        data=data_folder,  # the folder of input.data
        exec=image_exec(),  # "apptainer exec ... IMAGE " with container.mode apptainer
    shell:
        "{params.exec}ddppipe evaluate --checkpoint {input.checkpoint} --data {params.data}"
        " --metrics {output.metrics} --plot {output.plot} 2> {log}"


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
    """Final weights and a provenance record (code, software, hosts, seed, data, attempts)."""
    input:
        checkpoint="results/{run}/train/final.pt",
        attempts="results/{run}/train/attempts.json",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
        image=image_input(),
    output:
        weights="results/{run}/export/model.pt",
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
    params:
        data=data_folder,  # the folder of input.data
        image_info=image_info_arg(),  # records the image's SHA-256 in the provenance
    shell:
        "ddppipe export --checkpoint {input.checkpoint} --data {params.data}"
        " --weights {output.weights} --provenance {output.provenance} {params.image_info}"
        " --attempts {input.attempts}"
        " 2> {log}"
