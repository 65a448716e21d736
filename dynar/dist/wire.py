"""The 16-bit formats gradients can travel in between ranks (`--compress`, the allreduce's
`wire=`): values are rounded to them for the network and summed in float32. fp16 keeps 11
bits of mantissa and overflows past 65504; bf16 keeps float32's range with 8 bits. Importing
this does not load MPI, so the command line can offer the choices."""

FORMATS = ("fp16", "bf16")
