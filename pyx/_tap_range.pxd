# Which output pixels a kernel tap reads from the real input rather than its zero padding.
#
# Along one axis, output index o reads input index o*stride - pad + offset for the tap at
# `offset`; the indices where that lies in [0, in_size) form one range [first, end). The
# im2col unfolding (conv.pyx) and the per-tap GEMMs (tapgemm.pyx) both work range by range, so
# no inner loop tests bounds pixel by pixel.


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
