"""Parameter: a trainable array and its gradient, both views into a model's flat buffers."""
import numpy as np


class Parameter:
    """`data` and `grad` (same shape, float32, C-contiguous).

    Until the owning model calls `flatten_parameters()` they are standalone arrays; after it,
    both are views into the model's `flat_params` / `flat_grads`, and `flat_slice` gives their
    place there: (flat_params, flat_grads, start), so an optimizer can find contiguous runs.
    """
    __slots__ = ("data", "grad", "flat_slice")

    def __init__(self, data):
        self.data = np.ascontiguousarray(data, dtype=np.float32)
        self.grad = np.zeros_like(self.data)
        self.flat_slice = None

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self):
        return self.data.size

    def __repr__(self):
        return f"Parameter(shape={self.data.shape})"
