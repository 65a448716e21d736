"""Reference architectures: each builder takes (num_classes=10, variant=..., seed=0)."""
from .alexnet import AlexNet, alexnet
from .base import Model
from .lenet import LeNet, lenet
from .registry import MODELS, get, names
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50
from .vgg import VGG, vgg11, vgg11_bn, vgg13, vgg13_bn, vgg16, vgg16_bn, vgg19, vgg19_bn

__all__ = ["get", "names", "MODELS", "Model", "LeNet", "AlexNet", "VGG", "ResNet",
           "BasicBlock", "Bottleneck", "lenet", "alexnet", "vgg11", "vgg13", "vgg16", "vgg19",
           "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn", "resnet18", "resnet34", "resnet50"]
