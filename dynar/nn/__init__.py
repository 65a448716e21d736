"""Layers, losses and the Module base, mirroring torch.nn names and argument order."""
from . import init
from .activation import ReLU
from .arena import StepArena
from .batchnorm import BatchNorm2d
from .container import Sequential
from .conv import Conv2d
from .dropout import Dropout
from .flatten import Flatten
from .linear import Linear
from .loss import CrossEntropyLoss
from .module import HookHandle, IncompatibleKeys, Module
from .parameter import Parameter
from .pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d

__all__ = ["init", "Module", "Parameter", "HookHandle", "IncompatibleKeys", "Sequential",
           "StepArena", "Conv2d", "Linear", "BatchNorm2d", "ReLU", "Dropout", "Flatten", "MaxPool2d",
           "AvgPool2d", "AdaptiveAvgPool2d", "CrossEntropyLoss"]
