"""Mixed precision: the layers that compute on bf16 operands, and whether this CPU can.

In "bf16" a convolution or fully connected layer reads its weight, its input and, in
backward, its output gradient rounded to bf16 (kernels/bf16: nearest-even, the same on every
path) and accumulates in float32. Everything else stays float32: parameters and their
gradients, the optimizer, the gradient allreduce, BatchNorm, the loss; but a ReLU whose
output the next layer reads in backward only as a bf16 operand keeps a bf16 copy of it for
backward (half the memory: docs/DESIGN.md, "Precision"). bf16 keeps float32's
exponent range, so gradients need no loss scaling (docs/DESIGN.md, "Precision").

Where this CPU has AMX, AVX512_BF16 or aarch64's BFMMLA, the products of im2col, Winograd,
the per-tap GEMMs (kernels/conv.bf16_kernel) and fully connected layers (kernels/bf16.matmul)
run on it (include/panel_gemm_bf16.h), rounding what they read. Elsewhere the rounded
operands are float32 arrays holding bf16 values, which the float32 kernels multiply exactly
as bf16 dot-product instructions do (a product of two bf16 values is exact in float32): the
portable path, correct on any CPU, at float32 speed (docs/notes/2026-12-05-bf16-numerics.md).
"""
import functools
import os

from ..kernels import conv
from ..kernels.bf16 import cpu_features, gemm_kernels, round_to_bf16, to_float32
from .activation import ReLU

PRECISIONS = ("fp32", "bf16")
# Set (to anything but "" or "0") to run bf16 on a CPU without bf16 instructions, where it
# is slower than fp32: the numerics can be developed and tested on any machine.
ANY_CPU_VARIABLE = "DYNAR_BF16_ANY_CPU"


def resolve(requested):
    """(the precision to run, a note for the start line or None) for `requested`: bf16
    where the CPU has bf16 instructions (kernels/bf16.cpu_features) or ANY_CPU_VARIABLE
    says so, else fp32, with a note saying why."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {requested!r}")
    if requested == "fp32":
        return "fp32", None
    features = cpu_features()
    if features:
        return "bf16", f"bf16 instructions: {', '.join(features)}; {kernels_used()}"
    if os.environ.get(ANY_CPU_VARIABLE, "0") not in ("", "0"):
        return "bf16", f"no bf16 instructions on this CPU; computed anyway ({ANY_CPU_VARIABLE})"
    return "fp32", ("--precision bf16: this CPU has no bf16 instructions (AVX512_BF16, AMX-BF16 "
                    "or aarch64 BF16); running fp32")


def kernels_used():
    """Which layers compute on bf16 instructions here, in words, for the start line."""
    fc = gemm_kernel()
    convs = (f"convolutions (im2col, Winograd, per-tap GEMMs) on {conv.bf16_kernel()}"
             if conv.bf16_kernels() else None)
    on = [part for part in (convs, fc and f"fully connected layers on {fc}") if part]
    if not on:
        return "dynar has no kernels for them here, so bf16 runs its portable path (fp32 speed)"
    return "; ".join(on) + "; the other products on the portable path (fp32 speed)"


@functools.cache
def gemm_kernel():
    """The bf16 GEMM kernel of kernels/bf16.matmul that layers use on this CPU, or None
    where only the portable one runs (which is slower than the portable path's BLAS)."""
    native = [name for name in gemm_kernels() if name != "portable"]
    return native[0] if native else None


def set_precision(model, precision):
    """Every convolution and fully connected layer of `model` computes in `precision`, and
    in bf16 its ReLUs keep bf16 copies of their outputs where those layers are next."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    for layer in model.modules():
        if isinstance(layer, (Bf16Operands, ReLU)):
            layer.precision = precision
    return model


class Bf16Operands:
    """Mixed into a layer whose kernels take (weight, input) forward and (dy, input, weight)
    backward: hands them the bf16-rounded operands when `precision` is "bf16".

    Every rounded operand is scratch, given back once the kernel has run, and rounded again
    in backward rather than kept: a rounded weight kept from forward to backward would add a
    copy of every weight to the step's peak memory, where rounding it again costs one pass
    over it. The input is kept as the layer before hands it over: where that is a ReLU
    keeping a bf16 copy of it (activation.py), the layer keeps the copy, and backward widens
    it into scratch: the values its rounding would read (Winograd, which transforms before
    it rounds, then reads one rounding more: docs/DESIGN.md, "Precision")."""
    precision = "fp32"
    _scratch_w = _scratch_x = _scratch_dy = None
    _x = _x16 = None

    def input_needed_in_backward(self):
        return "bf16" if self.precision == "bf16" else "float32"

    def _keep_input(self, x):
        """Keeps forward's input for backward: its bf16 copy where the arena has one."""
        copy = None
        if self.precision == "bf16" and self._arena is not None:
            copy = self._arena.bf16_copy(x)
        self._x, self._x16 = (x, None) if copy is None else (None, copy)

    def _kept_input(self):
        """(the input forward kept, as float32; the scratch to give back after)."""
        if self._x16 is None:
            return self._x, ()
        x = to_float32(self._scratch("_scratch_x", self._x16.shape), self._x16)
        return x, (x,)

    def _rounds_itself(self):
        """Whether this layer's kernels read their operands rounded to bf16 themselves (bf16
        instructions that round as they pack), so that rounding them first would only add a
        pass over each and its scratch."""
        return False

    def _forward_operands(self, x):
        """(input, weight) the forward kernel reads, and the scratch to give back after."""
        if self.precision == "fp32" or self._rounds_itself():
            return x, self.weight.data, ()
        w = self._rounded("_scratch_w", self.weight.data)
        xr = self._rounded("_scratch_x", x)
        return xr, w, (xr, w)

    def _backward_operands(self, dy):
        """(dy, input, weight) the backward kernel reads, and the scratch to give back."""
        x, widened = self._kept_input()
        if self.precision == "fp32" or self._rounds_itself():
            return dy, x, self.weight.data, widened
        dyr = self._rounded("_scratch_dy", dy)
        xr = x if widened else self._rounded("_scratch_x", x)
        w = self._rounded("_scratch_w", self.weight.data)
        return dyr, xr, w, (dyr, xr, w)

    def _rounded(self, name, array):
        """`array` rounded to bf16, in scratch."""
        return round_to_bf16(self._scratch(name, array.shape), array)

    def _scratch(self, name, shape):
        if self._arena is not None:
            return self._arena.take(shape)
        buffer = self._reuse(getattr(self, name), shape)
        setattr(self, name, buffer)
        return buffer

    def _give_back(self, scratch):
        if self._arena is not None:
            for array in scratch:
                self._arena.passed_on(array)
