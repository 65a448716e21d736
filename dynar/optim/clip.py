"""Gradient clipping by global norm, as torch.nn.utils.clip_grad_norm_ (norm 2): every
gradient is scaled by min(1, max_norm / (norm + 1e-6)), norm taken over all of them."""
import numpy as np

# Squares are summed in float32 blocks of this many elements (numpy, one thread: the same
# bytes give the same figure whatever the thread count), the blocks' sums in float64.
_BLOCK = 1 << 16


def squared_norm(array, ranges=None):
    """The sum of squares of the 1-D float32 `array` (of its [lo, hi) `ranges` if given), as
    a Python float."""
    total = 0.0
    for lo, hi in ranges if ranges is not None else [(0, array.size)]:
        for start in range(lo, hi, _BLOCK):
            block = array[start:min(start + _BLOCK, hi)]
            total += float(np.einsum("i,i->", block, block))
    return total


def clip_coefficient(norm, max_norm):
    """What the gradients are multiplied by: 1 when norm <= max_norm (nearly: torch's 1e-6)."""
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm!r}")
    return min(1.0, max_norm / (norm + 1e-6))


def clip_grad_norm_(model, max_norm):
    """Scale `model`'s gradients (its flat_grads) to a global 2-norm of at most max_norm, in
    place; returns the norm before clipping. Across ranks, DataParallel.clip_grad_norm_
    takes the norm of the averaged gradient instead."""
    norm = float(np.sqrt(squared_norm(model.flat_grads)))
    scale_gradients(model.flat_grads, clip_coefficient(norm, max_norm))
    return norm


def scale_gradients(array, coefficient, ranges=None):
    """array (or its ranges) *= coefficient, in place; nothing at all for 1."""
    if coefficient == 1.0:
        return
    for lo, hi in ranges if ranges is not None else [(0, array.size)]:
        view = array[lo:hi]
        np.multiply(view, np.float32(coefficient), out=view)
