"""What a run records of itself, for people: its scalars, continued across requeues, in
TensorBoard, MLflow and W&B (:mod:`ddppipe.training.tracking.run_tracking` fans them out to the
backends, one module each), and the provenance of what it trained (code, software, hardware,
data, config).
"""
