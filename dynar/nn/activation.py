"""ReLU."""
import numpy as np

from ..kernels.activation import relu_backward, relu_forward
from .module import Module


class ReLU(Module):
    """inplace=True overwrites the input in forward and dy in backward (no extra buffer):
    safe wherever the layer before keeps its *input* for backward, not its output, which
    holds for conv, linear, batch norm and pooling.

    Its backward needs only the sign of its output. In a model in bf16 precision (set by
    precision.set_precision) whose next layer reads this output in backward as bf16 at
    most, it keeps a bf16 copy of the output (written in the same pass, half the memory)
    for that and for the next layer, and the float32 output goes after the next forward."""

    _keeps = ("_y", "_y16")
    precision = "fp32"

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace
        self._y = self._y16 = None
        self._copy_output = False

    def keep_output_as_bf16(self, wanted):
        self._copy_output = (wanted and self.precision == "bf16" and self.training
                             and self._arena is not None)
        return self._copy_output

    def forward(self, x):
        y = x if self.inplace else self._keep(self._y, x.shape)
        # (Asked under an arena; the model may since run without one: a small pass.)
        if self._copy_output and self._arena is not None:
            self._y16 = self._keep(None, x.shape, np.uint16)
            relu_forward(y, x, self._y16)
            self._arena.note_bf16_copy(y, self._y16)
            self._y = None
        else:
            relu_forward(y, x)
            self._y, self._y16 = y, None
        return y

    def backward(self, dy):
        if not self.input_requires_grad:
            return None
        dx = dy if self.inplace else self._grad_buffer(dy.shape)
        # The mask of the bf16 copy differs only where the output is subnormal (0 in bf16).
        relu_backward(dx, dy, self._y if self._y16 is None else self._y16)
        return dx

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""
