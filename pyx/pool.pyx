"""2-D max and average pooling (floor mode, as PyTorch's defaults), and global average pooling.

Every (image, channel) plane pools independently, so each op is one loop over the N*C planes
that `prange` shares out; a plane is computed start to finish by one thread, which makes the
result independent of the thread count, bit for bit. Backward ops zero their plane of dx and
scatter dy back into it in the same order as the forward visited the windows. That is also
the order of PyTorch's CPU kernels, so float32 max and average pooling have matched PyTorch
2.13 bit for bit in our parity runs (the tests allow a few ulps all the same).

Window geometry is shared: output o covers input rows [o*stride - pad, o*stride - pad + k),
clipped to the input. Padding counts as -inf for max pooling and as zeros for average pooling
(count_include_pad=True: the divisor is always kh*kw). With padding <= kernel//2, as PyTorch
requires, every window holds at least one real input element.

Global average pooling is average pooling with one window the size of the plane: y (N, C) and
dy (N, C) have the same memory layout as (N, C, 1, 1).
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport INFINITY
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset
cimport numpy as cnp

from _parallel cimport threads_for
from _tap_range cimport check_window_fits, window_positions
from _validate cimport (F32, FloatKind, as_int, check_array, check_disjoint, check_float,
                        check_pair, check_shape, data, float_kind)

cnp.import_array()


cdef struct PoolShape:
    Py_ssize_t N, C, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo


cdef inline void _window(Py_ssize_t o, Py_ssize_t k, Py_ssize_t stride, Py_ssize_t pad,
                         Py_ssize_t size, Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    """[lo, hi): the input indices that output index o pools over, clipped to [0, size)."""
    cdef Py_ssize_t start = o * stride - pad
    cdef Py_ssize_t end = start + k
    lo[0] = start if start > 0 else 0
    hi[0] = end if end < size else size


cdef void _maxpool_plane(floating* y, int64_t* argmax, const floating* x,
                         const PoolShape* s) noexcept nogil:
    """y, argmax: (Ho, Wo); x: (H, W)."""
    cdef Py_ssize_t oh, ow, h, w, h0, h1, w0, w1, best_at
    cdef floating best, v
    for oh in range(s.Ho):
        _window(oh, s.kh, s.sh, s.ph, s.H, &h0, &h1)
        for ow in range(s.Wo):
            _window(ow, s.kw, s.sw, s.pw, s.W, &w0, &w1)
            # As PyTorch: start from -inf at the first real element, take strictly greater
            # values (ties keep the first in row-major order) and any NaN (NaN propagates;
            # its index is the last NaN of the window).
            best = -INFINITY
            best_at = h0 * s.W + w0
            for h in range(h0, h1):
                for w in range(w0, w1):
                    v = x[h * s.W + w]
                    if v > best or v != v:
                        best = v
                        best_at = h * s.W + w
            y[oh * s.Wo + ow] = best
            argmax[oh * s.Wo + ow] = best_at


cdef extern from "maxpool_row.h" nogil:
    void maxpool2x2_row_f(float* y, int64_t* argmax, const float* r0, const float* r1,
                          Py_ssize_t wo, int64_t first, int64_t W)
    void maxpool2x2_row_d(double* y, int64_t* argmax, const double* r0, const double* r1,
                          Py_ssize_t wo, int64_t first, int64_t W)


cdef void _maxpool_plane_2x2(floating* y, int64_t* argmax, const floating* x,
                             const PoolShape* s) noexcept nogil:
    """_maxpool_plane for 2x2 windows at stride 2 without padding (every VGG pool): the
    same result, vectorized along each output row (include/maxpool_row.h)."""
    cdef Py_ssize_t oh
    for oh in range(s.Ho):
        if floating is float:
            maxpool2x2_row_f(y + oh * s.Wo, argmax + oh * s.Wo, x + 2 * oh * s.W,
                             x + (2 * oh + 1) * s.W, s.Wo, 2 * oh * s.W, s.W)
        else:
            maxpool2x2_row_d(y + oh * s.Wo, argmax + oh * s.Wo, x + 2 * oh * s.W,
                             x + (2 * oh + 1) * s.W, s.Wo, 2 * oh * s.W, s.W)


cdef void _avgpool_plane(floating* y, const floating* x, const PoolShape* s) noexcept nogil:
    """y: (Ho, Wo); x: (H, W)."""
    cdef Py_ssize_t oh, ow, h, w, h0, h1, w0, w1
    # As a floating product: a kernel as large as huge padding allows may overflow an integer.
    cdef double area = <double> s.kh * <double> s.kw
    # Sums in double: a float32 running sum stops growing once it is 2^24 times the
    # addends (global pooling of a large plane came out 128x too small).
    cdef double acc
    for oh in range(s.Ho):
        _window(oh, s.kh, s.sh, s.ph, s.H, &h0, &h1)
        for ow in range(s.Wo):
            _window(ow, s.kw, s.sw, s.pw, s.W, &w0, &w1)
            acc = 0
            for h in range(h0, h1):
                for w in range(w0, w1):
                    acc = acc + x[h * s.W + w]
            y[oh * s.Wo + ow] = <floating> (acc / area)


cdef void _maxpool_plane_backward(floating* dx, const floating* dy, const int64_t* argmax,
                                  const PoolShape* s) noexcept nogil:
    """dx: (H, W), accumulated into; dy, argmax: (Ho, Wo), argmax values in [0, H*W)."""
    cdef Py_ssize_t o
    for o in range(s.Ho * s.Wo):
        dx[argmax[o]] += dy[o]


cdef void _avgpool_plane_backward(floating* dx, const floating* dy,
                                  const PoolShape* s) noexcept nogil:
    """dx: (H, W), accumulated into; dy: (Ho, Wo)."""
    cdef Py_ssize_t oh, ow, h, w, h0, h1, w0, w1
    cdef floating area = <floating> (<double> s.kh * <double> s.kw)
    cdef floating g
    for oh in range(s.Ho):
        _window(oh, s.kh, s.sh, s.ph, s.H, &h0, &h1)
        for ow in range(s.Wo):
            _window(ow, s.kw, s.sw, s.pw, s.W, &w0, &w1)
            g = dy[oh * s.Wo + ow] / area
            for h in range(h0, h1):
                for w in range(w0, w1):
                    dx[h * s.W + w] += g


cdef void _forward(floating* y, int64_t* argmax, const floating* x, PoolShape s,
                   int threads) noexcept nogil:
    """y: (N, C, Ho, Wo); argmax: (N, C, Ho, Wo), NULL for average pooling; x: (N, C, H, W)."""
    cdef Py_ssize_t plane
    cdef Py_ssize_t in_size = s.H * s.W
    cdef Py_ssize_t out_size = s.Ho * s.Wo
    # Parallel over planes: planes are independent and there are N*C of them (hundreds even
    # at batch 1), where one plane can be as small as 2x2.
    for plane in prange(s.N * s.C, schedule="static", num_threads=threads):
        if argmax != NULL and s.kh == 2 and s.kw == 2 and s.sh == 2 and s.sw == 2 \
                and s.ph == 0 and s.pw == 0:
            _maxpool_plane_2x2(y + plane * out_size, argmax + plane * out_size,
                               x + plane * in_size, &s)
        elif argmax != NULL:
            _maxpool_plane(y + plane * out_size, argmax + plane * out_size,
                           x + plane * in_size, &s)
        else:
            _avgpool_plane(y + plane * out_size, x + plane * in_size, &s)


cdef void _backward(floating* dx, const floating* dy, const int64_t* argmax, PoolShape s,
                    int threads) noexcept nogil:
    """dx: (N, C, H, W), overwritten; dy: (N, C, Ho, Wo); argmax: (N, C, Ho, Wo), NULL for
    average pooling."""
    cdef Py_ssize_t plane
    cdef Py_ssize_t in_size = s.H * s.W
    cdef Py_ssize_t out_size = s.Ho * s.Wo
    # Parallel over planes, as the forward: overlapping windows only ever add into their own
    # plane of dx, so threads never write to the same element and need no reduction.
    for plane in prange(s.N * s.C, schedule="static", num_threads=threads):
        memset(dx + plane * in_size, 0, in_size * sizeof(floating))
        if argmax != NULL:
            _maxpool_plane_backward(dx + plane * in_size, dy + plane * out_size,
                                    argmax + plane * out_size, &s)
        else:
            _avgpool_plane_backward(dx + plane * in_size, dy + plane * out_size, &s)


cdef object _run_forward(FloatKind kind, object y, object argmax, object x, PoolShape s):
    cdef void* yp = data(y)
    cdef int64_t* ap = <int64_t*> data(argmax)
    cdef void* xp = data(x)
    cdef int threads = threads_for(s.N * s.C)
    with nogil:
        if kind == F32:
            _forward(<float*> yp, ap, <float*> xp, s, threads)
        else:
            _forward(<double*> yp, ap, <double*> xp, s, threads)


cdef object _run_backward(FloatKind kind, object dx, object dy, object argmax, PoolShape s):
    cdef void* dxp = data(dx)
    cdef void* dyp = data(dy)
    cdef int64_t* ap = <int64_t*> data(argmax)
    cdef int threads = threads_for(s.N * s.C)
    with nogil:
        if kind == F32:
            _backward(<float*> dxp, <float*> dyp, ap, s, threads)
        else:
            _backward(<double*> dxp, <double*> dyp, ap, s, threads)


cdef tuple _checked_dims(str name, object shape):
    """`shape` as a 4-tuple of ints >= 1, else ValueError/TypeError naming `name`."""
    try:
        dims = tuple([as_int(name, d) for d in shape])
    except TypeError:
        raise TypeError(f"{name}: expected a shape (N, C, H, W), got {shape!r}") from None
    if len(dims) != 4:
        raise ValueError(f"{name}: expected 4 dimensions (N, C, H, W), got shape {dims}")
    if any(d < 1 for d in dims):
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {dims}")
    if any(d > 1 << 40 for d in dims):   # beyond any array; keeps index arithmetic in range
        raise ValueError(f"{name}: unreasonably large, got shape {dims}")
    return dims


cdef PoolShape _pool_shape(str x_name, object x_shape, object kernel, object stride,
                           object padding) except *:
    """Validated geometry of pooling an input of shape x_shape, errors naming x_name."""
    cdef PoolShape s
    s.N, s.C, s.H, s.W = _checked_dims(x_name, x_shape)
    s.kh, s.kw = check_pair("kernel", kernel, 1)
    s.sh, s.sw = (s.kh, s.kw) if stride is None else check_pair("stride", stride, 1)
    s.ph, s.pw = check_pair("padding", padding, 0)
    if s.ph > s.kh // 2 or s.pw > s.kw // 2:
        raise ValueError(f"padding: must be at most half the kernel ({s.kh}x{s.kw}), "
                         f"got {padding!r}")
    check_window_fits("kernel:", s.kh, s.kw, s.H, s.W, s.ph, s.pw)
    s.Ho = window_positions(s.H, s.kh, s.sh, s.ph)
    s.Wo = window_positions(s.W, s.kw, s.sw, s.pw)
    return s


def pool2d_output_shape(x_shape, kernel, stride=None, padding=0):
    """(N, C, H_out, W_out) of max or average pooling x_shape (N, C, H, W), floor mode.

    kernel, stride, padding: int or (h, w); stride None means stride = kernel. As PyTorch,
    padding may be at most kernel // 2. ValueError/TypeError naming what is wrong."""
    cdef PoolShape s = _pool_shape("x", x_shape, kernel, stride, padding)
    return (s.N, s.C, s.Ho, s.Wo)


def maxpool2d_forward(y, argmax, x, kernel, stride=None, padding=0):
    """y (N, C, H_out, W_out) = max over each window of x (N, C, H, W); argmax (N, C, H_out,
    W_out), int64, = h * W + w of the max in its input plane.

    y and argmax are overwritten. Padding acts as -inf; ties keep the first element in
    row-major window order; a window holding NaN gives NaN. kernel, stride, padding as
    pool2d_output_shape."""
    cdef FloatKind kind = float_kind("x", x)
    xa = check_float("x", x, 4, kind)
    cdef PoolShape s = _pool_shape("x", (<object> xa).shape, kernel, stride, padding)
    out_shape = (s.N, s.C, s.Ho, s.Wo)
    ya = check_float("y", y, 4, kind, output=True)
    check_shape("y", ya, out_shape)
    aa = check_array("argmax", argmax, 4, cnp.NPY_INT64, output=True)
    check_shape("argmax", aa, out_shape)
    check_disjoint("y", ya, "x", xa)
    check_disjoint("argmax", aa, "x", xa)
    check_disjoint("argmax", aa, "y", ya)
    _run_forward(kind, ya, aa, xa, s)


cdef Py_ssize_t _count_out_of_range(const int64_t* a, Py_ssize_t n,
                                    uint64_t limit) noexcept nogil:
    # Unsigned compare: a negative index wraps to a huge value, so one test covers both ends.
    cdef Py_ssize_t i, bad = 0
    for i in range(n):
        bad += <uint64_t> a[i] >= limit
    return bad


def maxpool2d_backward(dx, dy, argmax):
    """dx (N, C, H, W) = dy (N, C, H_out, W_out) routed to the input elements argmax (N, C,
    H_out, W_out) (from maxpool2d_forward) selected, summed where windows overlap.

    dx is overwritten. ValueError if an argmax value is outside [0, H*W)."""
    cdef FloatKind kind = float_kind("dy", dy)
    dya = check_float("dy", dy, 4, kind)
    dy_shape = _checked_dims("dy", (<object> dya).shape)
    dxa = check_float("dx", dx, 4, kind, output=True)
    dx_shape = _checked_dims("dx", (<object> dxa).shape)
    if dx_shape[:2] != dy_shape[:2]:
        raise ValueError(f"dx: expected (N, C) = {dy_shape[:2]} as dy, got shape {dx_shape}")
    aa = check_array("argmax", argmax, 4, cnp.NPY_INT64)
    check_shape("argmax", aa, dy_shape)
    check_disjoint("dx", dxa, "dy", dya)
    check_disjoint("dx", dxa, "argmax", aa)
    cdef PoolShape s
    s.N, s.C, s.H, s.W = dx_shape
    s.Ho, s.Wo = dy_shape[2], dy_shape[3]
    # A bad index would write outside dx: refuse before any kernel runs.
    cdef const int64_t* ap = <int64_t*> data(aa)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(aa)
    cdef Py_ssize_t bad
    with nogil:
        bad = _count_out_of_range(ap, n, <uint64_t> (s.H * s.W))
    if bad:
        raise ValueError(f"argmax: {bad} values outside [0, H*W) = [0, {s.H * s.W})")
    _run_backward(kind, dxa, dya, aa, s)


def avgpool2d_forward(y, x, kernel, stride=None, padding=0):
    """y (N, C, H_out, W_out) = mean over each window of x (N, C, H, W), padding counted as
    zeros (count_include_pad=True). y is overwritten. kernel, stride, padding as
    pool2d_output_shape."""
    cdef FloatKind kind = float_kind("x", x)
    xa = check_float("x", x, 4, kind)
    cdef PoolShape s = _pool_shape("x", (<object> xa).shape, kernel, stride, padding)
    ya = check_float("y", y, 4, kind, output=True)
    check_shape("y", ya, (s.N, s.C, s.Ho, s.Wo))
    check_disjoint("y", ya, "x", xa)
    _run_forward(kind, ya, None, xa, s)


def avgpool2d_backward(dx, dy, kernel, stride=None, padding=0):
    """dx (N, C, H, W) = gradient of avgpool2d_forward given dy (N, C, H_out, W_out).

    dx is overwritten."""
    cdef FloatKind kind = float_kind("dy", dy)
    dya = check_float("dy", dy, 4, kind)
    dxa = check_float("dx", dx, 4, kind, output=True)
    cdef PoolShape s = _pool_shape("dx", (<object> dxa).shape, kernel, stride, padding)
    check_shape("dy", dya, (s.N, s.C, s.Ho, s.Wo))
    check_disjoint("dx", dxa, "dy", dya)
    _run_backward(kind, dxa, dya, None, s)


cdef PoolShape _global_shape(str x_name, object x, str y_name, object y) except *:
    """Geometry of global average pooling x (N, C, H, W) into y (N, C)."""
    N, C, H, W = _checked_dims(x_name, (<object> x).shape)
    check_shape(y_name, y, (N, C))
    check_disjoint(y_name, y, x_name, x)
    return _pool_shape(x_name, (N, C, H, W), (H, W), None, 0)


def global_avgpool_forward(y, x):
    """y (N, C) = mean of each plane of x (N, C, H, W); y is overwritten."""
    cdef FloatKind kind = float_kind("x", x)
    xa = check_float("x", x, 4, kind)
    ya = check_float("y", y, 2, kind, output=True)
    _run_forward(kind, ya, None, xa, _global_shape("x", xa, "y", ya))


def global_avgpool_backward(dx, dy):
    """dx (N, C, H, W) = dy (N, C) / (H*W) broadcast over each plane; dx is overwritten."""
    cdef FloatKind kind = float_kind("dy", dy)
    dya = check_float("dy", dy, 2, kind)
    dxa = check_float("dx", dx, 4, kind, output=True)
    _run_backward(kind, dxa, dya, None, _global_shape("dx", dxa, "dy", dya))
