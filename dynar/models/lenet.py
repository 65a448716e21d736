"""LeNet-5 for 1x28x28 MNIST digits (the first conv pads 2, as the original's 32x32 input)."""
from collections import OrderedDict

import numpy as np

from ..nn import Conv2d, Flatten, Linear, MaxPool2d, ReLU
from .base import Model, input_shape


class LeNet(Model):
    def __init__(self, num_classes=10, variant="mnist", seed=0):
        shape = input_shape("lenet", variant, {"mnist": (1, 28, 28)})
        g = np.random.default_rng(seed)
        super().__init__(OrderedDict([
            ("conv1", Conv2d(1, 6, 5, padding=2, generator=g)),
            ("relu1", ReLU(inplace=True)),
            ("pool1", MaxPool2d(2)),
            ("conv2", Conv2d(6, 16, 5, generator=g)),
            ("relu2", ReLU(inplace=True)),
            ("pool2", MaxPool2d(2)),
            ("flatten", Flatten()),
            ("fc1", Linear(16 * 5 * 5, 120, generator=g)),
            ("relu3", ReLU(inplace=True)),
            ("fc2", Linear(120, 84, generator=g)),
            ("relu4", ReLU(inplace=True)),
            ("fc3", Linear(84, num_classes, generator=g)),
        ]), shape, g)


def lenet(num_classes=10, variant="mnist", seed=0):
    return LeNet(num_classes, variant, seed)
