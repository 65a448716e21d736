"""Model names -> builders, for `models.get(name, ...)` and the command line."""
from .alexnet import alexnet
from .lenet import lenet
from .resnet import resnet18, resnet34, resnet50
from .vgg import vgg11, vgg11_bn, vgg13, vgg13_bn, vgg16, vgg16_bn, vgg19, vgg19_bn

MODELS = {fn.__name__: fn for fn in (
    lenet, alexnet, vgg11, vgg13, vgg16, vgg19, vgg11_bn, vgg13_bn, vgg16_bn, vgg19_bn,
    resnet18, resnet34, resnet50)}


def names():
    return list(MODELS)


def get(name, **kwargs):
    """MODELS[name](**kwargs), e.g. get("resnet18", num_classes=10, variant="cifar", seed=0)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)
