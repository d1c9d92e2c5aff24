"""Experiment tracking: the job's `tracking` section and, only when it has one, the MLflow client (mlflow_run)."""
