"""VGG 11/13/16/19, with or without batch norm: torchvision's for 3x224x224; for 3x32x32
the same `features` followed by one Linear(512, num_classes) named `classifier`."""
from collections import OrderedDict

import numpy as np

from ..nn import (AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d,
                  ReLU, Sequential, init)
from .base import Model, input_shape

# Output channels of each 3x3 conv, "M" a 2x2 max pool (torchvision's configurations A, B, D, E).
CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"],
}


def _features(config, batch_norm, g):
    layers = []
    channels = 3
    for v in config:
        if v == "M":
            layers.append(MaxPool2d(2, stride=2))
            continue
        layers.append(Conv2d(channels, v, 3, padding=1, generator=g))
        if batch_norm:
            layers.append(BatchNorm2d(v))
        layers.append(ReLU(inplace=True))
        channels = v
    return Sequential(*layers)


class VGG(Model):
    """config: a key of CONFIGS; dropout: p of the imagenet classifier's two Dropouts."""

    def __init__(self, config, batch_norm=False, num_classes=10, variant="cifar", seed=0,
                 dropout=0.5):
        name = config + ("_bn" if batch_norm else "")
        shape = input_shape(name, variant, {"cifar": (3, 32, 32), "imagenet": (3, 224, 224)})
        g = np.random.default_rng(seed)
        stages = OrderedDict(features=_features(CONFIGS[config], batch_norm, g))
        if variant == "imagenet":
            stages["avgpool"] = AdaptiveAvgPool2d((7, 7))
            stages["flatten"] = Flatten()
            stages["classifier"] = Sequential(
                Linear(512 * 7 * 7, 4096, generator=g), ReLU(inplace=True),
                Dropout(dropout, generator=g),
                Linear(4096, 4096, generator=g), ReLU(inplace=True),
                Dropout(dropout, generator=g),
                Linear(4096, num_classes, generator=g))
        else:
            stages["flatten"] = Flatten()
            stages["classifier"] = Linear(512, num_classes, generator=g)
        # torchvision's VGG initialization, replacing the layers' torch defaults
        for stage in stages.values():
            for m in stage.modules():
                if isinstance(m, Conv2d):
                    init.kaiming_normal_(m.weight.data, g, mode="fan_out", nonlinearity="relu")
                    m.bias.data.fill(0)
                elif isinstance(m, Linear):
                    init.normal_(m.weight.data, 0.01, g)
                    m.bias.data.fill(0)
        super().__init__(stages, shape, g)


def vgg11(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg11", False, num_classes, variant, seed, dropout)


def vgg13(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg13", False, num_classes, variant, seed, dropout)


def vgg16(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg16", False, num_classes, variant, seed, dropout)


def vgg19(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg19", False, num_classes, variant, seed, dropout)


def vgg11_bn(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg11", True, num_classes, variant, seed, dropout)


def vgg13_bn(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg13", True, num_classes, variant, seed, dropout)


def vgg16_bn(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg16", True, num_classes, variant, seed, dropout)


def vgg19_bn(num_classes=10, variant="cifar", seed=0, dropout=0.5):
    return VGG("vgg19", True, num_classes, variant, seed, dropout)
