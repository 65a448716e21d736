# A window sliding along one axis of a padded plane (a convolution's kernel, a pooling's
# window): how many output positions it has, and which of them a kernel tap reads from the
# real input rather than its zero padding.
#
# Output index o reads input index o*stride - pad + offset for the tap at `offset`; the
# indices where that lies in [0, in_size) form one range [first, end). The im2col unfolding
# (im2col.pyx) and the per-tap GEMMs (tapgemm.pyx) both work range by range, so no inner loop
# tests bounds pixel by pixel.


cdef inline Py_ssize_t window_positions(Py_ssize_t in_size, Py_ssize_t window,
                                        Py_ssize_t stride, Py_ssize_t pad) noexcept nogil:
    """Output positions of a window of `window` elements (at most in_size + 2*pad) sliding
    at `stride` over in_size elements padded by `pad` on both sides."""
    return (in_size + 2 * pad - window) // stride + 1


cdef inline object check_window_fits(str what, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t H,
                                     Py_ssize_t W, Py_ssize_t ph, Py_ssize_t pw):
    """ValueError saying `what` kh x kw is larger than the padded input, unless it fits."""
    if kh > H + 2 * ph or kw > W + 2 * pw:
        raise ValueError(f"{what} {kh}x{kw} is larger than the padded input "
                         f"{H + 2 * ph}x{W + 2 * pw}")


cdef inline Py_ssize_t tap_first_valid(Py_ssize_t pad, Py_ssize_t offset, Py_ssize_t stride,
                                       Py_ssize_t out_size) noexcept nogil:
    """First output index o with o*stride - pad + offset >= 0 (out_size if none)."""
    cdef Py_ssize_t need = pad - offset
    if need <= 0:
        return 0
    need = (need + stride - 1) // stride
    return need if need < out_size else out_size


cdef inline Py_ssize_t tap_end_valid(Py_ssize_t pad, Py_ssize_t offset, Py_ssize_t stride,
                                     Py_ssize_t in_size, Py_ssize_t out_size) noexcept nogil:
    """One past the last output index o with o*stride - pad + offset < in_size."""
    cdef Py_ssize_t last = in_size - 1 + pad - offset
    if last < 0:
        return 0
    last = last // stride + 1
    return last if last < out_size else out_size
