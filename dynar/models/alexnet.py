"""AlexNet: torchvision's for 3x224x224, and a 3x32x32 CIFAR variant with the same
module indices (features.N / classifier.N), so state_dicts carry over name for name."""
from collections import OrderedDict

import numpy as np

from ..nn import AdaptiveAvgPool2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU, Sequential
from .base import Model, input_shape


class AlexNet(Model):
    """dropout: p of the two classifier Dropout layers (0 turns them into identities, for
    exact comparisons with another framework or between rank counts)."""

    def __init__(self, num_classes=10, variant="cifar", seed=0, dropout=0.5):
        shape = input_shape("alexnet", variant, {"cifar": (3, 32, 32), "imagenet": (3, 224, 224)})
        g = np.random.default_rng(seed)
        stages = OrderedDict()
        if variant == "imagenet":
            stages["features"] = Sequential(
                Conv2d(3, 64, 11, stride=4, padding=2, generator=g), ReLU(inplace=True),
                MaxPool2d(3, stride=2),
                Conv2d(64, 192, 5, padding=2, generator=g), ReLU(inplace=True),
                MaxPool2d(3, stride=2),
                Conv2d(192, 384, 3, padding=1, generator=g), ReLU(inplace=True),
                Conv2d(384, 256, 3, padding=1, generator=g), ReLU(inplace=True),
                Conv2d(256, 256, 3, padding=1, generator=g), ReLU(inplace=True),
                MaxPool2d(3, stride=2))
            stages["avgpool"] = AdaptiveAvgPool2d((6, 6))
            flat = 256 * 6 * 6
        else:
            stages["features"] = Sequential(
                Conv2d(3, 64, 3, stride=2, padding=1, generator=g), ReLU(inplace=True),
                MaxPool2d(2),
                Conv2d(64, 192, 3, padding=1, generator=g), ReLU(inplace=True),
                MaxPool2d(2),
                Conv2d(192, 384, 3, padding=1, generator=g), ReLU(inplace=True),
                Conv2d(384, 256, 3, padding=1, generator=g), ReLU(inplace=True),
                Conv2d(256, 256, 3, padding=1, generator=g), ReLU(inplace=True),
                MaxPool2d(2))
            flat = 256 * 2 * 2
        stages["flatten"] = Flatten()
        stages["classifier"] = Sequential(
            Dropout(dropout, generator=g),
            Linear(flat, 4096, generator=g), ReLU(inplace=True),
            Dropout(dropout, generator=g),
            Linear(4096, 4096, generator=g), ReLU(inplace=True),
            Linear(4096, num_classes, generator=g))
        super().__init__(stages, shape, g)


def alexnet(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return AlexNet(num_classes, variant, seed, dropout)
