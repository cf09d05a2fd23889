rule evaluate:
    """Test-set metrics of the final checkpoint and its confusion matrix."""
    input:
        checkpoint="results/{run}/train/final.pt",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
    output:
        metrics="results/{run}/eval/metrics.json",
        plot=report(
            "results/{run}/eval/confusion_matrix.png",
            caption="../report/confusion_matrix.rst",
            category="Evaluation",
        ),
    log:
        "logs/{run}/evaluate.log",
    benchmark:
        "benchmarks/{run}/evaluate.tsv"
    shell:
        "ddppipe evaluate --checkpoint {input.checkpoint} --data {DATA}"
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
        ),
    log:
        "logs/{run}/plot_training.log",
    localrule: True
    shell:
        "ddppipe plot-training --metrics {input} --out {output} 2> {log}"


rule export:
    """Final weights and a provenance record (code, software, hosts, seed, data checksums)."""
    input:
        checkpoint="results/{run}/train/final.pt",
        data=expand(f"{DATA}/{{name}}", name=MNIST_FILES),
    output:
        weights="results/{run}/export/model.pt",
        provenance="results/{run}/export/provenance.json",
    log:
        "logs/{run}/export.log",
    benchmark:
        "benchmarks/{run}/export.tsv"
    shell:
        "ddppipe export --checkpoint {input.checkpoint} --data {DATA}"
        " --weights {output.weights} --provenance {output.provenance} 2> {log}"
