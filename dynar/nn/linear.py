"""Linear: y = x @ w^T + b over (N, in) float32."""
import numpy as np

from ..kernels.linear import linear_backward, linear_forward
from . import init
from .module import Module
from .parameter import Parameter


class Linear(Module):
    _keeps = ("_x", "_y")

    def __init__(self, in_features, out_features, bias=True, generator=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        generator = np.random.default_rng() if generator is None else generator
        self.weight = Parameter(np.empty((out_features, in_features), np.float32))
        self.bias = Parameter(np.empty(out_features, np.float32)) if bias else None
        init.torch_default_(self.weight.data, None if self.bias is None else self.bias.data,
                            generator)
        self._x = self._y = None

    def forward(self, x):
        self._y = self._keep(self._y, (x.shape[0], self.out_features))
        linear_forward(self._y, x, self.weight.data, None if self.bias is None else self.bias.data)
        self._x = x
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._grad_buffer(self._x.shape)
        linear_backward(dx, self.weight.grad, None if self.bias is None else self.bias.grad,
                        dy, self._x, self.weight.data)
        self._grad_ready()
        return dx

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
