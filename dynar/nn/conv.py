"""Conv2d over NCHW float32, weights OIHW: im2col/GEMM, or Winograd F(2x2, 3x3) for the 3x3
stride-1 layers where it is faster."""
import numpy as np

from ..kernels.conv import conv2d_backward, conv2d_forward, conv2d_output_shape
from ..kernels.winograd import (winograd_backward, winograd_forward, winograd_preferred,
                                winograd_supports)
from . import init
from .module import Module
from .parameter import Parameter

ALGORITHMS = ("auto", "gemm", "winograd")


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class Conv2d(Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 generator=None):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride = _pair(stride)
        self.padding = _pair(padding)
        generator = np.random.default_rng() if generator is None else generator
        self.weight = Parameter(np.empty((out_channels, in_channels) + self.kernel_size,
                                         np.float32))
        self.bias = Parameter(np.empty(out_channels, np.float32)) if bias else None
        init.torch_default_(self.weight.data, None if self.bias is None else self.bias.data,
                            generator)
        self._algorithm = "auto"
        self._x = self._y = self._dx = None
        self._x_shape = None
        self._winograd = False

    @property
    def algorithm(self):
        """"auto" (Winograd where winograd_preferred says so, else im2col/GEMM), "gemm" or
        "winograd" (3x3, stride 1 only)."""
        return self._algorithm

    @algorithm.setter
    def algorithm(self, value):
        if value not in ALGORITHMS:
            raise ValueError(f"Conv2d.algorithm: expected one of {ALGORITHMS}, got {value!r}")
        if value == "winograd" and not winograd_supports(self.weight.shape, self.stride):
            raise ValueError(f"Conv2d.algorithm: winograd needs a 3x3 kernel at stride 1, "
                             f"this layer has {self.kernel_size} at stride {self.stride}")
        self._algorithm = value
        self._x_shape = None   # choose again at the next forward

    def forward(self, x):
        if x.shape != self._x_shape:
            self._x_shape = x.shape
            self._y = np.empty(conv2d_output_shape(x.shape, self.weight.shape, self.stride,
                                                   self.padding), np.float32)
            self._winograd = self._algorithm == "winograd" or (
                self._algorithm == "auto" and winograd_preferred(
                    x.shape, self.weight.shape, self.stride, self.padding))
        bias = None if self.bias is None else self.bias.data
        if self._winograd:
            winograd_forward(self._y, x, self.weight.data, bias, self.padding)
        else:
            conv2d_forward(self._y, x, self.weight.data, bias, self.stride, self.padding)
        self._x = x
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._dx = self._reuse(self._dx, self._x_shape)
        db = None if self.bias is None else self.bias.grad
        if self._winograd:
            winograd_backward(dx, self.weight.grad, db, dy, self._x, self.weight.data,
                              self.padding)
        else:
            conv2d_backward(dx, self.weight.grad, db, dy, self._x, self.weight.data,
                            self.stride, self.padding)
        self._grad_ready()
        return dx

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")
