"""Parameter: a trainable array and its gradient, both views into a model's flat buffers."""
from typing import NamedTuple

import numpy as np


class FlatPlacement(NamedTuple):
    """Where a parameter lives in its model's flat buffers: data is
    params[offset:offset + size], grad the same slice of grads."""
    params: np.ndarray
    grads: np.ndarray
    offset: int


class Parameter:
    """`data` and `grad` (same shape, float32, C-contiguous).

    Until the owning model calls `flatten_parameters()` they are standalone arrays; after it,
    both are views into the model's `flat_params` / `flat_grads`, and `placement` (a
    FlatPlacement) says where, so an optimizer can find contiguous runs.
    """
    __slots__ = ("data", "grad", "placement")

    def __init__(self, data):
        self.data = np.ascontiguousarray(data, dtype=np.float32)
        self.grad = np.zeros_like(self.data)
        self.placement = None

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self):
        return self.data.size

    def __repr__(self):
        return f"Parameter(shape={self.data.shape})"
