"""The 16-bit formats gradients can travel in between ranks (`--compress`, the allreduce's
`wire=`): values are rounded to them for the network and summed in float32. fp16 keeps 11
bits of mantissa and overflows past 65504; bf16 keeps float32's range with 8 bits. Importing
this does not load MPI, so the command line can offer the choices."""

FORMATS = ("fp16", "bf16")


def wire_id(name):
    """The extension's id of a wire format (pyx/allreduce.pyx's Wire enum): 0 for None (the
    buffer's own type), then FORMATS in order."""
    if name is None:
        return 0
    try:
        return 1 + FORMATS.index(name)
    except ValueError:
        raise ValueError(f"wire: unknown wire format {name!r}; choose "
                         f"{', '.join(FORMATS)} or None") from None
