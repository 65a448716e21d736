"""Dropout: zero each element with probability p in training, scale the rest by 1/(1-p)."""
import numpy as np

from ..kernels.activation import dropout_backward, dropout_forward
from .module import Module


class Dropout(Module):
    """The kernel's mask is a pure function of (seed, element index); every forward draws a
    fresh seed from `generator`. Models pass the Generator they own, so a run is
    reproducible from the model's seed. Identity in eval mode and when p == 0."""

    _keeps = ("_y", "_mask")

    def input_needed_in_backward(self):
        # Its mask. But in place it changes its input, which a copy made before would miss,
        # and inactive it hands the input on: the next layer's needs are the input's.
        return None if self.training and self.p > 0 and not self.inplace else "float32"

    def __init__(self, p=0.5, inplace=False, generator=None):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p
        self.inplace = inplace
        self.generator = np.random.default_rng() if generator is None else generator
        self._y = self._mask = None
        self._active = False

    def forward(self, x):
        self._active = self.training and self.p > 0
        if not self._active:
            return x
        y = x if self.inplace else self._keep(self._y, x.shape)
        self._mask = self._keep(self._mask, x.shape, np.uint8)
        dropout_forward(y, self._mask, x, self.p, int(self.generator.integers(2**63)))
        self._y = y
        return y

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        if not self._active:
            return dy
        dx = dy if self.inplace else self._grad_buffer(dy.shape)
        dropout_backward(dx, dy, self._mask, self.p)
        return dx

    def extra_repr(self):
        return f"p={self.p}" + (", inplace=True" if self.inplace else "")
