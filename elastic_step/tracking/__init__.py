"""MLflow as the memory of every training run: parameters, metrics, events, plots, checkpoints
and the final model."""
