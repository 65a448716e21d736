"""2-D convolution by im2col + GEMM: forward, weight/bias gradient, input gradient.

Layout (as Caffe's base_conv_layer): for a group of G images, im2col unfolds the input into
col (K, G*P) with K = C_in*kh*kw rows and P = H_out*W_out output pixels per image; then
    forward:      out (C_out, G*P) = w (C_out, K) @ col (K, G*P)          [+ bias]
    weight grad:  dw  (C_out, K)  += dy (C_out, G*P) @ col^T (G*P, K)
    input grad:   dcol (K, G*P)    = w^T (K, C_out) @ dy (C_out, G*P);  col2im(dcol) -> dx
G > 1 only where one image gives a skinny GEMM (late layers at 8x8 and below): BLAS runs
wide GEMMs much faster, and the gather/scatter copies cost little next to K-deep products.

Parallelism: `prange` over image groups, one BLAS thread per OpenMP thread, thread-private
im2col buffers. Weight and bias gradients go to per-thread partial sums that are reduced in
fixed thread order afterwards (parallel over the weight elements), so a run is deterministic
for a given thread count.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
cimport numpy as cnp
cimport openmp

from _blas cimport gemm
from _validate cimport (F32, FloatKind, check_blas_dim, check_disjoint, check_float,
                        check_pair, check_shape, data, float_kind)

cnp.import_array()

# Columns (images x output pixels) per GEMM below which images are batched together.
DEF GEMM_MIN_COLUMNS = 256
# Batching stops short of leaving fewer than this many image groups to share out.
DEF MIN_GROUPS = 8


cdef inline Py_ssize_t _valid_lo(Py_ssize_t pad, Py_ssize_t offset, Py_ssize_t stride,
                                 Py_ssize_t out_size) noexcept nogil:
    """First output index o with o*stride - pad + offset >= 0."""
    cdef Py_ssize_t need = pad - offset
    if need <= 0:
        return 0
    need = (need + stride - 1) // stride
    return need if need < out_size else out_size


cdef inline Py_ssize_t _valid_hi(Py_ssize_t pad, Py_ssize_t offset, Py_ssize_t stride,
                                 Py_ssize_t in_size, Py_ssize_t out_size) noexcept nogil:
    """One past the last output index o with o*stride - pad + offset < in_size."""
    cdef Py_ssize_t last = in_size - 1 + pad - offset
    if last < 0:
        return 0
    last = last // stride + 1
    return last if last < out_size else out_size


cdef void im2col(floating* col, Py_ssize_t ld, const floating* x,
                 Py_ssize_t C, Py_ssize_t H, Py_ssize_t W, Py_ssize_t kh, Py_ssize_t kw,
                 Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t ph, Py_ssize_t pw,
                 Py_ssize_t Ho, Py_ssize_t Wo) noexcept nogil:
    """col: (C*kh*kw, ld), first Ho*Wo columns written; x: (C, H, W).

    Row by row with the padding ranges computed up front, so the inner loop is a plain copy
    (memcpy at stride 1) instead of a bounds test per element."""
    cdef Py_ssize_t c, i, j, oh, ih, ow, lo, hi
    cdef floating* dst
    cdef const floating* src
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                lo = _valid_lo(pw, j, sw, Wo)
                hi = _valid_hi(pw, j, sw, W, Wo)
                if hi < lo:
                    hi = lo
                dst = col + ((c * kh + i) * kw + j) * ld
                for oh in range(Ho):
                    ih = oh * sh - ph + i
                    if ih < 0 or ih >= H:
                        memset(dst, 0, Wo * sizeof(floating))
                    else:
                        if lo > 0:
                            memset(dst, 0, lo * sizeof(floating))
                        src = x + (c * H + ih) * W + lo * sw - pw + j
                        if sw == 1:
                            memcpy(dst + lo, src, (hi - lo) * sizeof(floating))
                        else:
                            for ow in range(hi - lo):
                                dst[lo + ow] = src[ow * sw]
                        if hi < Wo:
                            memset(dst + hi, 0, (Wo - hi) * sizeof(floating))
                    dst += Wo


cdef void col2im(floating* x, const floating* col, Py_ssize_t ld,
                 Py_ssize_t C, Py_ssize_t H, Py_ssize_t W, Py_ssize_t kh, Py_ssize_t kw,
                 Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t ph, Py_ssize_t pw,
                 Py_ssize_t Ho, Py_ssize_t Wo) noexcept nogil:
    """x: (C, H, W) overwritten with the sum of the columns of col (C*kh*kw, ld) that
    im2col would have read from each pixel."""
    cdef Py_ssize_t c, i, j, oh, ih, ow, lo, hi
    cdef const floating* src
    cdef floating* dst
    memset(x, 0, C * H * W * sizeof(floating))
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                lo = _valid_lo(pw, j, sw, Wo)
                hi = _valid_hi(pw, j, sw, W, Wo)
                src = col + ((c * kh + i) * kw + j) * ld
                for oh in range(Ho):
                    ih = oh * sh - ph + i
                    if ih >= 0 and ih < H:
                        dst = x + (c * H + ih) * W + lo * sw - pw + j
                        for ow in range(hi - lo):
                            dst[ow * sw] += src[lo + ow]
                    src += Wo


cdef struct ConvShape:
    Py_ssize_t N, C, H, W, Co, kh, kw, sh, sw, ph, pw, Ho, Wo
    Py_ssize_t K       # C*kh*kw, rows of col
    Py_ssize_t P       # Ho*Wo, columns of col per image
    Py_ssize_t G       # images per GEMM
    bint direct        # 1x1, stride 1, no padding, G == 1: col is the image itself


cdef inline Py_ssize_t _images_per_gemm(Py_ssize_t P, Py_ssize_t N) noexcept nogil:
    # Depends on the shapes only, never on the thread count: BLAS may sum in a different
    # order for a different GEMM width, and results must not change with --threads.
    cdef Py_ssize_t g = (GEMM_MIN_COLUMNS + P - 1) // P
    cdef Py_ssize_t keep_groups = N // MIN_GROUPS   # leave work for MIN_GROUPS threads
    if g > keep_groups:
        g = keep_groups
    return g if g >= 1 else 1


cdef ConvShape _conv_shape(tuple xs, tuple ws, tuple stride, tuple padding) except *:
    cdef ConvShape s
    s.N, s.C, s.H, s.W = xs
    s.Co, s.kh, s.kw = ws[0], ws[2], ws[3]
    s.sh, s.sw = stride
    s.ph, s.pw = padding
    s.Ho = (s.H + 2 * s.ph - s.kh) // s.sh + 1
    s.Wo = (s.W + 2 * s.pw - s.kw) // s.sw + 1
    s.K = s.C * s.kh * s.kw
    s.P = s.Ho * s.Wo
    s.G = _images_per_gemm(s.P, s.N)
    s.direct = s.kh == 1 and s.kw == 1 and s.sh == 1 and s.sw == 1 and s.ph == 0 \
        and s.pw == 0 and s.G == 1
    check_blas_dim("conv: C_in*kh*kw", s.K)
    check_blas_dim("conv: C_out", s.Co)
    check_blas_dim("conv: images*H_out*W_out per GEMM", s.G * s.P)
    return s


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0):
    """(N, C_out, H_out, W_out) of conv2d_forward, or ValueError naming what is wrong.

    x_shape: (N, C_in, H, W); w_shape: (C_out, C_in, kh, kw)."""
    xs = tuple(x_shape)
    ws = tuple(w_shape)
    if len(xs) != 4:
        raise ValueError(f"x: expected 4 dimensions (N, C, H, W), got shape {xs}")
    if len(ws) != 4:
        raise ValueError(f"w: expected 4 dimensions (C_out, C_in, kh, kw), got shape {ws}")
    if any(d < 1 for d in xs):
        raise ValueError(f"x: every dimension must be >= 1, got shape {xs}")
    if any(d < 1 for d in ws):
        raise ValueError(f"w: every dimension must be >= 1, got shape {ws}")
    if ws[1] != xs[1]:
        raise ValueError(f"w: expects {ws[1]} input channels, x has {xs[1]}")
    sh, sw = check_pair("stride", stride, 1)
    ph, pw = check_pair("padding", padding, 0)
    if ws[2] > xs[2] + 2 * ph or ws[3] > xs[3] + 2 * pw:
        raise ValueError(f"w: kernel {ws[2]}x{ws[3]} is larger than the padded input "
                         f"{xs[2] + 2 * ph}x{xs[3] + 2 * pw}")
    return (xs[0], ws[0], (xs[2] + 2 * ph - ws[2]) // sh + 1, (xs[3] + 2 * pw - ws[3]) // sw + 1)


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   ConvShape s, floating* work, Py_ssize_t work_per_thread,
                   int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t grp, n0, g, gn, co, p, cols
    cdef floating* col
    cdef floating* out
    cdef floating* yn
    cdef const floating* rhs
    cdef floating bias, beta
    # Parallel over image groups: each group is an independent GEMM, so no thread ever
    # waits on another and the result does not depend on the thread count.
    with parallel(num_threads=threads):
        col = work + threadid() * work_per_thread
        out = col + s.K * s.G * s.P
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            cols = gn * s.P
            if s.direct:
                rhs = x + n0 * s.C * s.P
            else:
                for g in range(gn):
                    im2col(col + g * s.P, cols, x + (n0 + g) * s.C * s.H * s.W, s.C, s.H,
                           s.W, s.kh, s.kw, s.sh, s.sw, s.ph, s.pw, s.Ho, s.Wo)
                rhs = col
            # One image: GEMM straight into y[n]; several: into a buffer, then scatter.
            yn = y + n0 * s.Co * s.P if gn == 1 else out
            beta = 0
            if b != NULL:
                beta = 1
                for co in range(s.Co):
                    bias = b[co]
                    for p in range(cols):
                        yn[co * cols + p] = bias
            gemm(False, False, <int> s.Co, <int> cols, <int> s.K, <floating> 1, w, <int> s.K,
                 rhs, <int> cols, beta, yn, <int> cols)
            if gn > 1:
                for g in range(gn):
                    for co in range(s.Co):
                        memcpy(y + ((n0 + g) * s.Co + co) * s.P, out + co * cols + g * s.P,
                               s.P * sizeof(floating))


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, ConvShape s,
                    floating* work, Py_ssize_t work_per_thread, floating* partials,
                    int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t wsize = s.Co * s.K
    cdef Py_ssize_t slot = wsize + s.Co
    cdef Py_ssize_t grp, n0, g, gn, co, p, cols, t, i
    cdef floating* col
    cdef floating* dyg
    cdef floating* dwt
    cdef floating* dbt
    cdef const floating* colp
    cdef const floating* dyp
    cdef floating acc
    memset(partials, 0, threads * slot * sizeof(floating))
    with parallel(num_threads=threads):
        col = work + threadid() * work_per_thread
        dyg = col + s.K * s.G * s.P
        dwt = partials + threadid() * slot
        dbt = dwt + wsize
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            cols = gn * s.P
            if gn == 1:
                dyp = dy + n0 * s.Co * s.P
            else:
                for g in range(gn):
                    for co in range(s.Co):
                        memcpy(dyg + co * cols + g * s.P, dy + ((n0 + g) * s.Co + co) * s.P,
                               s.P * sizeof(floating))
                dyp = dyg
            if s.direct:
                colp = x + n0 * s.C * s.P
            else:
                for g in range(gn):
                    im2col(col + g * s.P, cols, x + (n0 + g) * s.C * s.H * s.W, s.C, s.H,
                           s.W, s.kh, s.kw, s.sh, s.sw, s.ph, s.pw, s.Ho, s.Wo)
                colp = col
            gemm(False, True, <int> s.Co, <int> s.K, <int> cols, <floating> 1, dyp, <int> cols,
                 colp, <int> cols, <floating> 1, dwt, <int> s.K)
            if db != NULL:
                for co in range(s.Co):
                    acc = 0
                    for p in range(cols):
                        acc = acc + dyp[co * cols + p]
                    dbt[co] += acc
            if dx != NULL:
                # dcol overwrites col: its im2col content was consumed by the dw GEMM above.
                gemm(True, False, <int> s.K, <int> cols, <int> s.Co, <floating> 1, w, <int> s.K,
                     dyp, <int> cols, <floating> 0, col, <int> cols)
                for g in range(gn):
                    col2im(dx + (n0 + g) * s.C * s.H * s.W, col + g * s.P, cols, s.C, s.H,
                           s.W, s.kh, s.kw, s.sh, s.sw, s.ph, s.pw, s.Ho, s.Wo)
    # Reduce the per-thread partial sums in fixed thread order, parallel over elements.
    for i in prange(slot, schedule="static", num_threads=threads, nogil=True):
        acc = 0
        for t in range(threads):
            acc = acc + partials[t * slot + i]
        if i < wsize:
            dw[i] += acc
        elif db != NULL:
            db[i - wsize] += acc


cdef tuple _check_conv(str who, object x, object w, object b, object stride, object padding,
                       FloatKind* kind):
    kind[0] = float_kind("x", x)
    xa = check_float("x", x, 4, kind[0])
    wa = check_float("w", w, 4, kind[0])
    ba = None if b is None else check_float(who, b, 1, kind[0])
    out_shape = conv2d_output_shape((<object> xa).shape, (<object> wa).shape, stride, padding)
    if ba is not None:
        check_shape(who, ba, ((<object> wa).shape[0],))
    return xa, wa, ba, out_shape


def conv2d_forward(y, x, w, b=None, stride=1, padding=0):
    """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, kh, kw)) + b (C_out,).

    y is overwritten. b may be None. stride, padding: int or (h, w)."""
    cdef FloatKind kind
    xa, wa, ba, out_shape = _check_conv("b", x, w, b, stride, padding, &kind)
    ya = check_float("y", y, 4, kind, output=True)
    check_shape("y", ya, out_shape)
    check_disjoint("y", ya, "x", xa)
    check_disjoint("y", ya, "w", wa)
    cdef int threads = openmp.omp_get_max_threads()
    cdef ConvShape s = _conv_shape((<object> xa).shape, (<object> wa).shape, check_pair("stride", stride, 1),
                                   check_pair("padding", padding, 0))
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    if threads > groups:
        threads = <int> groups
    cdef Py_ssize_t per_thread = s.K * s.G * s.P + (s.Co * s.G * s.P if s.G > 1 else 0)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef void* work = malloc(threads * per_thread * itemsize + 1)
    if work == NULL:
        raise MemoryError(f"conv2d_forward: cannot allocate {threads * per_thread * itemsize} "
                          "bytes of im2col workspace")
    cdef void* yp = data(ya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef void* bp = data(ba)
    try:
        with nogil:
            if kind == F32:
                _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp,
                         s, <float*> work, per_thread, threads)
            else:
                _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp,
                         s, <double*> work, per_thread, threads)
    finally:
        free(work)


def conv2d_backward(dx, dw, db, dy, x, w, stride=1, padding=0):
    """Gradients of conv2d_forward given dy (N, C_out, H_out, W_out).

    dx (N, C_in, H, W) is overwritten (None skips the input gradient, as for a first layer);
    dw (C_out, C_in, kh, kw) and db (C_out,) are accumulated into (+=); db may be None."""
    cdef FloatKind kind
    xa, wa, dba, out_shape = _check_conv("db", x, w, db, stride, padding, &kind)
    dya = check_float("dy", dy, 4, kind)
    check_shape("dy", dya, out_shape)
    dwa = check_float("dw", dw, 4, kind, output=True)
    check_shape("dw", dwa, (<object> wa).shape)
    dxa = None
    if dx is not None:
        dxa = check_float("dx", dx, 4, kind, output=True)
        check_shape("dx", dxa, (<object> xa).shape)
        for name, other in (("dy", dya), ("x", xa), ("w", wa), ("dw", dwa)):
            check_disjoint("dx", dxa, name, other)
    for name, other in (("dy", dya), ("x", xa), ("w", wa)):
        check_disjoint("dw", dwa, name, other)
    cdef int threads = openmp.omp_get_max_threads()
    cdef ConvShape s = _conv_shape((<object> xa).shape, (<object> wa).shape, check_pair("stride", stride, 1),
                                   check_pair("padding", padding, 0))
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    if threads > groups:
        threads = <int> groups
    cdef Py_ssize_t per_thread = s.K * s.G * s.P + (s.Co * s.G * s.P if s.G > 1 else 0)
    cdef Py_ssize_t partial_size = threads * (s.Co * s.K + s.Co)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef void* work = malloc((threads * per_thread + partial_size) * itemsize + 1)
    if work == NULL:
        raise MemoryError("conv2d_backward: cannot allocate the im2col workspace")
    cdef void* dxp = data(dxa)
    cdef void* dwp = data(dwa)
    cdef void* dbp = data(dba)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    try:
        with nogil:
            if kind == F32:
                _backward(<float*> dxp, <float*> dwp, <float*> dbp, <float*> dyp, <float*> xp,
                          <float*> wp, s, <float*> work, per_thread,
                          <float*> work + threads * per_thread, threads)
            else:
                _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                          <double*> xp, <double*> wp, s, <double*> work, per_thread,
                          <double*> work + threads * per_thread, threads)
    finally:
        free(work)
