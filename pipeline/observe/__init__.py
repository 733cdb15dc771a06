"""Observability: trackers (TensorBoard, MLflow, W&B) and goodput."""
