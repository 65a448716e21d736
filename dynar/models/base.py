"""Model: the base of the reference architectures."""
from ..nn import Sequential


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
    the flat buffers from construction on."""

    def __init__(self, layers, input_shape, generator):
        super().__init__(layers)
        self.input_shape = input_shape
        self.generator = generator
        self.set_input_requires_grad(False)
        self.flatten_parameters()
