"""Training: the command line (cli), the training loop (loop) and its reporting (report)."""
from .loop import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
