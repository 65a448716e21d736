"""Max, average and adaptive average pooling over NCHW float32 (floor mode)."""
import numpy as np

from ..kernels.pool import (avgpool2d_backward, avgpool2d_forward, global_avgpool_backward,
                            global_avgpool_forward, maxpool2d_backward, maxpool2d_forward,
                            pool2d_output_shape)
from .module import Module


class MaxPool2d(Module):
    _keeps = ("_y", "_argmax")

    def input_needed_in_backward(self):
        return None     # its argmax and the input's shape

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding = padding
        self._x_shape = self._y = self._argmax = None

    def forward(self, x):
        self._x_shape = x.shape
        shape = pool2d_output_shape(x.shape, self.kernel_size, self.stride, self.padding)
        self._y = self._keep(self._y, shape)
        self._argmax = self._keep(self._argmax, shape, np.int64)
        maxpool2d_forward(self._y, self._argmax, x, self.kernel_size, self.stride, self.padding)
        return self._y

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        dx = self._grad_buffer(self._x_shape)
        maxpool2d_backward(dx, dy, self._argmax)
        return dx

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(Module):
    """count_include_pad=True, as torch's default."""

    _keeps = ("_y",)

    def input_needed_in_backward(self):
        return None     # the input's shape

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding = padding
        self._x_shape = self._y = None

    def forward(self, x):
        self._x_shape = x.shape
        self._y = self._keep(self._y, pool2d_output_shape(x.shape, self.kernel_size,
                                                          self.stride, self.padding))
        avgpool2d_forward(self._y, x, self.kernel_size, self.stride, self.padding)
        return self._y

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        dx = self._grad_buffer(self._x_shape)
        avgpool2d_backward(dx, dy, self.kernel_size, self.stride, self.padding)
        return dx

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    """Output size 1 (global average pooling, as ResNet's), or an output size equal to the
    input's, where it is the identity: torchvision's AlexNet (6x6) and VGG (7x7) keep this
    layer for inputs other than 224x224, which dynar's imagenet variants do not take."""

    _keeps = ("_y",)

    def input_needed_in_backward(self):
        # Of an input already of the output size it is the identity: the next layer's
        # needs are the input's.
        return None if self.output_size == (1, 1) else "float32"

    def __init__(self, output_size):
        super().__init__()
        self.output_size = ((output_size, output_size) if isinstance(output_size, int)
                            else tuple(output_size))
        self._x_shape = self._y = None

    def forward(self, x):
        self._x_shape = x.shape
        if self.output_size == (1, 1):
            self._y = self._keep(self._y, x.shape[:2])
            global_avgpool_forward(self._y, x)
            return self._y.reshape(x.shape[:2] + (1, 1))
        if x.shape[2:] == self.output_size:
            return x
        raise ValueError(f"AdaptiveAvgPool2d({self.output_size}): input {x.shape[2]}x"
                         f"{x.shape[3]} is supported only for output size 1 or an input "
                         "already of the output size")

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        if self.output_size != (1, 1):
            return dy
        dx = self._grad_buffer(self._x_shape)
        global_avgpool_backward(dx, dy.reshape(dy.shape[:2]))
        return dx

    def extra_repr(self):
        return f"output_size={self.output_size}"
