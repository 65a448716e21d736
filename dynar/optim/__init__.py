"""Optimizer and learning-rate schedules."""
from .lr_scheduler import CosineAnnealingLR, LinearWarmup, LRScheduler, MultiStepLR, StepLR
from .sgd import SGD

__all__ = ["SGD", "LRScheduler", "StepLR", "MultiStepLR", "CosineAnnealingLR", "LinearWarmup"]
