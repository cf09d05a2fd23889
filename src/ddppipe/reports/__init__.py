"""What a run reports: the summary, its HTML, plots, the scaling study's results."""
