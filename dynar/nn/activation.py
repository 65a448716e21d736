"""ReLU."""
from ..kernels.activation import relu_backward, relu_forward
from .module import Module


class ReLU(Module):
    """inplace=True overwrites the input in forward and dy in backward (no extra buffer):
    safe wherever the layer before keeps its *input* for backward, not its output, which
    holds for conv, linear, batch norm and pooling."""

    _keeps = ("_y",)

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace
        self._y = None

    def forward(self, x):
        y = x if self.inplace else self._keep(self._y, x.shape)
        relu_forward(y, x)
        self._y = y
        return y

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        dx = dy if self.inplace else self._grad_buffer(dy.shape)
        relu_backward(dx, dy, self._y)
        return dx

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""
