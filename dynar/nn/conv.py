"""Conv2d: im2col/GEMM convolution over NCHW float32, weights OIHW."""
import numpy as np

from ..kernels.conv import conv2d_backward, conv2d_forward, conv2d_output_shape
from . import init
from .module import Module
from .parameter import Parameter


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
        self._x = self._y = self._dx = None
        self._x_shape = None

    def forward(self, x):
        if x.shape != self._x_shape:
            self._x_shape = x.shape
            self._y = np.empty(conv2d_output_shape(x.shape, self.weight.shape, self.stride,
                                                   self.padding), np.float32)
        conv2d_forward(self._y, x, self.weight.data,
                       None if self.bias is None else self.bias.data, self.stride, self.padding)
        self._x = x
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._dx = self._reuse(self._dx, self._x_shape)
        conv2d_backward(dx, self.weight.grad, None if self.bias is None else self.bias.grad,
                        dy, self._x, self.weight.data, self.stride, self.padding)
        self._grad_ready()
        return dx

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")
