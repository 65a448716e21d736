"""Flatten: (N, C, H, W) -> (N, C*H*W) as a view (layer outputs are C-contiguous)."""
from .module import Module


class Flatten(Module):
    def __init__(self):
        super().__init__()
        self._x_shape = None

    def forward(self, x):
        self._x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        return dy.reshape(self._x_shape)
