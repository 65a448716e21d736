"""PyTorch definitions of dynar's reference architectures, module for module.

torchvision is not a test dependency, so its AlexNet, VGG and ResNet are restated here from
torch.nn with torchvision's module names; dynar's state_dict loads into these and back.
"""
from collections import OrderedDict

import torch
from torch import nn

VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"],
}


class Chain(nn.Sequential):
    """forward as Sequential, with torch.flatten before `classifier`/`fc` (torchvision's
    models flatten in forward, not with a module)."""

    def forward(self, x):
        for name, m in self.named_children():
            if name in ("classifier", "fc") and x.dim() > 2:
                x = torch.flatten(x, 1)
            x = m(x)
        return x


def lenet(num_classes=10):
    return Chain(OrderedDict([
        ("conv1", nn.Conv2d(1, 6, 5, padding=2)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(6, 16, 5)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(400, 120)), ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(120, 84)), ("relu4", nn.ReLU()),
        ("fc3", nn.Linear(84, num_classes))]))


def alexnet(num_classes=10, variant="cifar", dropout=0.0):
    stages = OrderedDict()
    if variant == "imagenet":
        stages["features"] = nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        stages["avgpool"] = nn.AdaptiveAvgPool2d((6, 6))
        flat = 256 * 36
    else:
        stages["features"] = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2, 1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        flat = 256 * 4
    stages["classifier"] = nn.Sequential(
        nn.Dropout(dropout), nn.Linear(flat, 4096), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, num_classes))
    return Chain(stages)


def vgg(config, batch_norm, num_classes=10, variant="cifar", dropout=0.0):
    layers, channels = [], 3
    for v in VGG_CONFIGS[config]:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        layers.append(nn.Conv2d(channels, v, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU())
        channels = v
    stages = OrderedDict(features=nn.Sequential(*layers))
    if variant == "imagenet":
        stages["avgpool"] = nn.AdaptiveAvgPool2d((7, 7))
        stages["classifier"] = nn.Sequential(
            nn.Linear(512 * 49, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4096, num_classes))
    else:
        stages["classifier"] = nn.Linear(512, num_classes)
    return Chain(stages)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride, downsample):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride, downsample):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


RESNET_DEPTHS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet34": (BasicBlock, (3, 4, 6, 3)),
                 "resnet50": (Bottleneck, (3, 4, 6, 3))}


def resnet(depth, num_classes=10, variant="cifar"):
    block, counts = RESNET_DEPTHS[depth]
    stages = OrderedDict()
    if variant == "imagenet":
        stages["conv1"] = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
    else:
        stages["conv1"] = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    stages["bn1"] = nn.BatchNorm2d(64)
    stages["relu"] = nn.ReLU()
    if variant == "imagenet":
        stages["maxpool"] = nn.MaxPool2d(3, 2, 1)
    inplanes = 64
    for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
        blocks = []
        for j in range(count):
            stride = 2 if i > 0 and j == 0 else 1
            out = planes * block.expansion
            down = None
            if stride != 1 or inplanes != out:
                down = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False),
                                     nn.BatchNorm2d(out))
            blocks.append(block(inplanes, planes, stride, down))
            inplanes = out
        stages[f"layer{i + 1}"] = nn.Sequential(*blocks)
    stages["avgpool"] = nn.AdaptiveAvgPool2d(1)
    stages["fc"] = nn.Linear(inplanes, num_classes)
    return Chain(stages)


def build(name, variant, num_classes=10):
    """The torch twin of dynar.models.get(name, variant=variant), dropout off."""
    if name == "lenet":
        return lenet(num_classes)
    if name == "alexnet":
        return alexnet(num_classes, variant)
    if name.startswith("vgg"):
        return vgg(name.removesuffix("_bn"), name.endswith("_bn"), num_classes, variant)
    return resnet(name, num_classes, variant)
