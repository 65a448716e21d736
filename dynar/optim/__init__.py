"""Optimizer, learning-rate schedules, gradient clipping."""
from .clip import clip_grad_norm_
from .lr_scheduler import CosineAnnealingLR, LinearWarmup, LRScheduler, MultiStepLR, StepLR
from .sgd import SGD

__all__ = ["SGD", "LRScheduler", "StepLR", "MultiStepLR", "CosineAnnealingLR", "LinearWarmup",
           "clip_grad_norm_"]
