"""Training: the command line (cli), its settings (config), what they build (build), the loop
(loop), its checkpoints (state) and its reporting (report)."""
from .config import TrainConfig
from .loop import TrainResult, Trainer, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]
