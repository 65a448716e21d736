"""ResNet 18/34/50 with torchvision's module names: torchvision's network for 3x224x224, and
for 3x32x32 a 3x3 stride-1 stem without max pool."""
from collections import OrderedDict

import numpy as np

from ..kernels.activation import add
from ..nn import (AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, Module,
                  ReLU, Sequential, init)
from .base import Model, input_shape


class _Residual(Module):
    """relu(main(x) + shortcut(x)); main is the block's conv/bn/relu chain, shortcut is
    `downsample` (1x1 conv + bn) where the shape changes, else the identity."""
    downsample = None

    def _finish(self, main, downsample):
        # children are registered in torchvision's order (main branch, then downsample), so
        # state_dict names and order match; backward below runs them in exact reverse
        self._main = tuple(main)
        self.relu = ReLU(inplace=True)
        if downsample is not None:
            self.downsample = downsample

    def forward(self, x):
        out = self._forward_through(self._main, x)
        # in place into the last BatchNorm's output: its backward needs its input only
        add(out, out, x if self.downsample is None else self.downsample.forward(x))
        return self.relu.forward(out)

    def input_needed_in_backward(self):
        # The identity shortcut reads x in forward only.
        readers = (self._main[0],) + (() if self.downsample is None else (self.downsample,))
        needs = {layer.input_needed_in_backward() for layer in readers}
        return "float32" if "float32" in needs else "bf16" if "bf16" in needs else None

    def keep_output_as_bf16(self, wanted):
        return self.relu.keep_output_as_bf16(wanted)

    def backward(self, dy):
        arena = self._arena
        d = self.relu.backward(dy)            # in place: d is dy
        if arena is not None:
            self.relu._release_kept()
            arena.passed_on(dy, d)
            arena.share(d)                    # both branches read it
        # Shortcut first: it was registered last, so its gradients come first in the flat
        # layout. Its first backward op is a BatchNorm, which only reads d, leaving d intact
        # for the main branch.
        d_shortcut = d if self.downsample is None else self.downsample.backward(d)
        dx = self._backward_through(self._main, d)
        add(dx, dx, d_shortcut)   # the branches' gradients join; dx is conv1's d(input)
        if arena is not None:
            arena.passed_on(d_shortcut, dx)
        return dx


def _downsample(inplanes, outplanes, stride, g):
    if stride == 1 and inplanes == outplanes:
        return None
    return Sequential(Conv2d(inplanes, outplanes, 1, stride=stride, bias=False, generator=g),
                      BatchNorm2d(outplanes))


class BasicBlock(_Residual):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, generator=None):
        super().__init__()
        self.conv1 = Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False,
                            generator=generator)
        self.bn1 = BatchNorm2d(planes)
        self.relu1 = ReLU(inplace=True)
        self.conv2 = Conv2d(planes, planes, 3, padding=1, bias=False, generator=generator)
        self.bn2 = BatchNorm2d(planes)
        self._finish((self.conv1, self.bn1, self.relu1, self.conv2, self.bn2),
                     _downsample(inplanes, planes, stride, generator))


class Bottleneck(_Residual):
    """torchvision's (ResNet v1.5): the stride sits on the 3x3 conv."""
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, generator=None):
        super().__init__()
        self.conv1 = Conv2d(inplanes, planes, 1, bias=False, generator=generator)
        self.bn1 = BatchNorm2d(planes)
        self.relu1 = ReLU(inplace=True)
        self.conv2 = Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False,
                            generator=generator)
        self.bn2 = BatchNorm2d(planes)
        self.relu2 = ReLU(inplace=True)
        self.conv3 = Conv2d(planes, planes * 4, 1, bias=False, generator=generator)
        self.bn3 = BatchNorm2d(planes * 4)
        self._finish((self.conv1, self.bn1, self.relu1, self.conv2, self.bn2, self.relu2,
                      self.conv3, self.bn3),
                     _downsample(inplanes, planes * 4, stride, generator))


# block type and blocks per stage (layer1..layer4)
DEPTHS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


class ResNet(Model):
    def __init__(self, depth, num_classes=10, variant="cifar", seed=0):
        shape = input_shape(depth, variant, {"cifar": (3, 32, 32), "imagenet": (3, 224, 224)})
        block, counts = DEPTHS[depth]
        g = np.random.default_rng(seed)
        stages = OrderedDict()
        if variant == "imagenet":
            stages["conv1"] = Conv2d(3, 64, 7, stride=2, padding=3, bias=False, generator=g)
        else:
            stages["conv1"] = Conv2d(3, 64, 3, stride=1, padding=1, bias=False, generator=g)
        stages["bn1"] = BatchNorm2d(64)
        stages["relu"] = ReLU(inplace=True)
        if variant == "imagenet":
            stages["maxpool"] = MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
            blocks = []
            for j in range(count):
                blocks.append(block(inplanes, planes, 2 if i > 0 and j == 0 else 1, g))
                inplanes = planes * block.expansion
            stages[f"layer{i + 1}"] = Sequential(*blocks)
        stages["avgpool"] = AdaptiveAvgPool2d(1)
        stages["flatten"] = Flatten()
        stages["fc"] = Linear(inplanes, num_classes, generator=g)
        # torchvision's initialization of the convolutions (BatchNorm starts at 1, 0 anyway;
        # fc keeps the torch default)
        for stage in stages.values():
            for m in stage.modules():
                if isinstance(m, Conv2d):
                    init.kaiming_normal_(m.weight.data, g, mode="fan_out", nonlinearity="relu")
        super().__init__(stages, shape, g)


def resnet18(num_classes=10, variant="cifar", seed=0):
    return ResNet("resnet18", num_classes, variant, seed)


def resnet34(num_classes=10, variant="cifar", seed=0):
    return ResNet("resnet34", num_classes, variant, seed)


def resnet50(num_classes=10, variant="cifar", seed=0):
    return ResNet("resnet50", num_classes, variant, seed)
