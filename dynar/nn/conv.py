"""Conv2d over NCHW float32, weights OIHW: im2col/GEMM, Winograd F(2x2, 3x3) on the 3x3
stride-1 layers where it is faster, the direct kernels on stride-1 layers with few channels,
or one GEMM per kernel tap on the smallest planes (the choice: conv_algorithms.py)."""
import numpy as np

from ..kernels import conv as conv_kernels
from ..kernels.conv import output_shape
from . import conv_algorithms, init
from .module import Module
from .parameter import Parameter
from .precision import Bf16Operands

ALGORITHMS = ("auto",) + tuple(conv_algorithms.ALGORITHMS)
# The algorithms whose bf16=True calls compute every product on bf16 instructions where
# kernels.conv.bf16_kernels() says so.
ROUNDING_ALGORITHMS = ("gemm", "winograd", "tapgemm")


def rounds_itself(algorithm):
    """Whether `algorithm`'s bf16 calls round what they read on this CPU, so that a bf16
    layer hands it its operands as they are; else the layer rounds them into scratch
    first (the portable path)."""
    return algorithm in ROUNDING_ALGORITHMS and conv_kernels.bf16_kernels()


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class Conv2d(Bf16Operands, Module):
    _keeps = ("_x", "_x16", "_y")

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
        self._y = None
        self._x_shape = self._y_shape = None
        self._kernel = "gemm"   # the algorithm the current input shape runs on, and its entries
        self._run_forward = self._run_backward = None

    @property
    def algorithm(self):
        """"auto" (the algorithm conv_algorithms.preferred names), "gemm" (im2col/GEMM),
        "winograd" (3x3, stride 1 only), "direct" (stride 1 only) or "tapgemm" (one GEMM per
        kernel tap)."""
        return self._algorithm

    @algorithm.setter
    def algorithm(self, value):
        if value not in ALGORITHMS:
            raise ValueError(f"Conv2d.algorithm: expected one of {ALGORITHMS}, got {value!r}")
        kernel = conv_algorithms.ALGORITHMS.get(value)
        if kernel is not None and not kernel.supports(self.weight.shape, self.stride,
                                                      self.padding):
            raise ValueError(f"Conv2d.algorithm: {value} needs {kernel.needs}, this layer has "
                             f"{self.kernel_size} at stride {self.stride}")
        self._algorithm = value
        self._x_shape = None   # choose again at the next forward

    def forward(self, x):
        if x.shape != self._x_shape:
            self._x_shape = x.shape
            self._y_shape = output_shape(x.shape, self.weight.shape, self.stride, self.padding)
            self._kernel = self._choose(x.shape)
            kernel = conv_algorithms.ALGORITHMS[self._kernel]
            self._run_forward, self._run_backward = kernel.forward, kernel.backward
        self._y = self._keep(self._y, self._y_shape)
        bias = None if self.bias is None else self.bias.data
        xr, w, scratch = self._forward_operands(x)
        self._run_forward(self._y, xr, w, bias, self.stride, self.padding,
                          bf16=self.precision == "bf16")
        self._give_back(scratch)
        self._keep_input(x)
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._grad_buffer(self._x_shape)
        db = None if self.bias is None else self.bias.grad
        dyr, xr, w, scratch = self._backward_operands(dy)
        self._zero_stale_grads()
        self._run_backward(dx, self.weight.grad, db, dyr, xr, w, self.stride, self.padding,
                           bf16=self.precision == "bf16")
        self._give_back(scratch)
        self._grad_ready()
        return dx

    def _rounds_itself(self):
        # These algorithms' bf16 products round every operand they read; Winograd rounds its
        # transformed tiles rather than the input and output gradient.
        return self.precision == "bf16" and rounds_itself(self._kernel)

    @property
    def kernel(self):
        """The algorithm the last forward ran: "gemm", "winograd", "direct" or "tapgemm"."""
        return self._kernel

    def _choose(self, x_shape):
        if self._algorithm != "auto":
            return self._algorithm
        return conv_algorithms.preferred(x_shape, self.weight.shape, self.stride, self.padding)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")
