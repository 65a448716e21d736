"""Sequential: children run in order; backward runs them in reverse."""
from collections import OrderedDict

from .module import Module


class Sequential(Module):
    """Sequential(layer, layer, ...) names children "0", "1", ...;
    Sequential(OrderedDict(name=layer, ...)) names them as given (torch accepts both)."""

    def __init__(self, *layers):
        super().__init__()
        if len(layers) == 1 and isinstance(layers[0], OrderedDict):
            items = layers[0].items()
        else:
            items = ((str(i), layer) for i, layer in enumerate(layers))
        for name, layer in items:
            setattr(self, name, layer)
        self._layers = tuple(self._modules.values())

    def __getitem__(self, index):
        return self._layers[index]

    def __len__(self):
        return len(self._layers)

    def __iter__(self):
        return iter(self._layers)

    def forward(self, x):
        return self._forward_through(self._layers, x)

    def input_needed_in_backward(self):
        return self._layers[0].input_needed_in_backward() if self._layers else "float32"

    def keep_output_as_bf16(self, wanted):
        return bool(self._layers) and self._layers[-1].keep_output_as_bf16(wanted)

    def backward(self, dy):
        return self._backward_through(self._layers, dy)

    def set_input_requires_grad(self, flag):
        super().set_input_requires_grad(flag)
        if self._layers:
            self._layers[0].set_input_requires_grad(flag)
        return self
