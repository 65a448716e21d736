"""Model: the base of the reference architectures."""
from ..nn import Sequential, StepArena


def input_shape(name, variant, shapes):
    """shapes[variant], the (C, H, W) input of that variant, or ValueError listing them."""
    if variant not in shapes:
        raise ValueError(f"{name}: unknown variant {variant!r}; valid: {', '.join(shapes)}")
    return shapes[variant]


class Model(Sequential):
    """A Sequential of named stages (so state_dict names come out as torchvision's), built
    from one seeded numpy Generator that the model keeps: it drew the initial weights and
    goes on seeding the Dropout masks, so a run is reproducible from the seed.

    The input is data, so the first layer skips d(input); parameters and gradients live in
    the flat buffers from construction on. The arrays the layers hand each other (outputs
    kept for backward, gradients) come from `step_arena` (a StepArena; None: every layer
    keeps its own), each forward starting a pass: what a forward or backward returned is
    valid until the model's next forward. Kinds of passes too small to gain from it (the
    arena says which) run on the layers' own buffers."""

    def __init__(self, layers, input_shape, generator):
        super().__init__(layers)
        self.input_shape = input_shape
        self.generator = generator
        self.set_input_requires_grad(False)
        self.flatten_parameters()
        self.step_arena = StepArena()

    def forward(self, x):
        arena = self.step_arena
        if arena is not None:
            arena.finish()
            key = (self.training, x.shape)
            wanted = None if arena.small(key) else arena
            if self._arena is not wanted:
                self.use_arena(wanted)
            if wanted is not None:
                arena.begin(key)
        elif self._arena is not None:
            self.use_arena(None)
        y = super().forward(x)
        if self._arena is not None:
            self._arena.share(y)    # the caller's until the next forward, backward or not
        return y

    def flatten_parameters(self):
        flat = super().flatten_parameters()
        self._parameter_layers = tuple(m for m in self.modules() if m._parameters)
        return flat

    def backward(self, dy):
        dx = super().backward(dy)
        for layer in self._parameter_layers:   # lazily zeroed, and not reached
            layer._zero_stale_grads()
        return dx
