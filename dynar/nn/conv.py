"""Conv2d over NCHW float32, weights OIHW: im2col/GEMM, Winograd F(2x2, 3x3) on the 3x3
stride-1 layers where it is faster, the direct kernels on stride-1 layers with few channels,
or one GEMM per kernel tap on the smallest planes."""
import numpy as np

from ..kernels.conv import conv2d_backward, conv2d_forward, conv2d_output_shape
from ..kernels.direct import direct_backward, direct_forward, direct_preferred, direct_supports
from ..kernels.tapgemm import tapgemm_backward, tapgemm_forward, tapgemm_preferred
from ..kernels.winograd import (winograd_backward, winograd_forward, winograd_preferred,
                                winograd_supports)
from . import init
from .module import Module
from .parameter import Parameter

ALGORITHMS = ("auto", "gemm", "winograd", "direct", "tapgemm")

# kernel -> (forward, backward). Winograd and direct compute stride 1 only and take no stride.
_KERNELS = {
    "gemm": (conv2d_forward, conv2d_backward),
    "tapgemm": (tapgemm_forward, tapgemm_backward),
    "winograd": (winograd_forward, winograd_backward),
    "direct": (direct_forward, direct_backward),
}
_STRIDE_ONE_ONLY = ("winograd", "direct")


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def preferred_kernel(x_shape, w_shape, stride, padding):
    """The kernel "auto" runs a layer on, by measurement (`python -m perf kernels`): the
    direct kernels for few channel pairs, else the per-tap GEMMs on outputs of 4x4 and less,
    else Winograd for 3x3 stride-1 layers, else im2col/GEMM ("gemm")."""
    for name, preferred in (("direct", direct_preferred), ("tapgemm", tapgemm_preferred),
                            ("winograd", winograd_preferred)):
        if preferred(x_shape, w_shape, stride, padding):
            return name
    return "gemm"


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
        self._kernel = "gemm"   # the algorithm the current input shape runs on

    @property
    def algorithm(self):
        """"auto" (the kernel preferred_kernel names), "gemm" (im2col/GEMM), "winograd" (3x3,
        stride 1 only), "direct" (stride 1 only) or "tapgemm" (one GEMM per kernel tap)."""
        return self._algorithm

    @algorithm.setter
    def algorithm(self, value):
        if value not in ALGORITHMS:
            raise ValueError(f"Conv2d.algorithm: expected one of {ALGORITHMS}, got {value!r}")
        if value == "winograd" and not winograd_supports(self.weight.shape, self.stride):
            raise ValueError(f"Conv2d.algorithm: winograd needs a 3x3 kernel at stride 1, "
                             f"this layer has {self.kernel_size} at stride {self.stride}")
        if value == "direct" and not direct_supports(self.weight.shape, self.stride):
            raise ValueError(f"Conv2d.algorithm: direct needs stride 1, this layer has "
                             f"stride {self.stride}")
        self._algorithm = value
        self._x_shape = None   # choose again at the next forward

    def forward(self, x):
        if x.shape != self._x_shape:
            self._x_shape = x.shape
            self._y = np.empty(conv2d_output_shape(x.shape, self.weight.shape, self.stride,
                                                   self.padding), np.float32)
            self._kernel = self._choose(x.shape)
        bias = None if self.bias is None else self.bias.data
        forward, _ = _KERNELS[self._kernel]
        forward(self._y, x, self.weight.data, bias, *self._geometry())
        self._x = x
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._dx = self._reuse(self._dx, self._x_shape)
        db = None if self.bias is None else self.bias.grad
        _, backward = _KERNELS[self._kernel]
        backward(dx, self.weight.grad, db, dy, self._x, self.weight.data, *self._geometry())
        self._grad_ready()
        return dx

    @property
    def kernel(self):
        """The algorithm the last forward ran: "gemm", "winograd", "direct" or "tapgemm"."""
        return self._kernel

    def _geometry(self):
        if self._kernel in _STRIDE_ONE_ONLY:
            return (self.padding,)
        return (self.stride, self.padding)

    def _choose(self, x_shape):
        if self._algorithm != "auto":
            return self._algorithm
        return preferred_kernel(x_shape, self.weight.shape, self.stride, self.padding)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")
