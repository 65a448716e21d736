"""Weight initializers, as torch.nn.init, drawing from an explicit numpy Generator.

Values are drawn in float32 straight into the parameter: no float64 temporary the size of
VGG's 100M-element classifier.
"""
import math

import numpy as np


def _fans(shape):
    """(fan_in, fan_out) of a weight of shape (out, in, *kernel), as torch computes them."""
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _gain(nonlinearity, a):
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + a * a))
    raise ValueError(f"nonlinearity: expected 'relu' or 'leaky_relu', got {nonlinearity!r}")


def uniform_(w, bound, generator):
    """w ~ U(-bound, bound), in place."""
    generator.random(out=w.reshape(-1), dtype=np.float32)
    w *= 2 * bound
    w -= bound
    return w


def normal_(w, std, generator):
    """w ~ N(0, std^2), in place."""
    generator.standard_normal(out=w.reshape(-1), dtype=np.float32)
    w *= std
    return w


def kaiming_uniform_(w, generator, a=0.0, mode="fan_in", nonlinearity="leaky_relu"):
    fan_in, fan_out = _fans(w.shape)
    std = _gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out)
    return uniform_(w, math.sqrt(3.0) * std, generator)


def kaiming_normal_(w, generator, a=0.0, mode="fan_in", nonlinearity="leaky_relu"):
    fan_in, fan_out = _fans(w.shape)
    return normal_(w, _gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out),
                   generator)


def torch_default_(weight, bias, generator):
    """PyTorch's reset_parameters() of Conv2d and Linear: Kaiming-uniform with a = sqrt(5) for
    the weight (which works out to U(+-1/sqrt(fan_in))), U(+-1/sqrt(fan_in)) for the bias."""
    kaiming_uniform_(weight, generator, a=math.sqrt(5))
    if bias is not None:
        uniform_(bias, 1 / math.sqrt(_fans(weight.shape)[0]), generator)
