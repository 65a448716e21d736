"""2-D convolution by im2col + GEMM: forward, weight/bias gradient, input gradient.

Layout (as Caffe's base_conv_layer): for a group of G images, im2col unfolds the input into
col (K, G*P) with K = C_in*kh*kw rows and P = H_out*W_out output pixels per image; then
    forward:      out (C_out, G*P) = w (C_out, K) @ col (K, G*P)          [+ bias]
    weight grad:  dw^T (K, C_out) += col (K, G*P) @ dy^T (G*P, C_out)
    input grad:   dcol (K, G*P)    = w^T (K, C_out) @ dy (C_out, G*P);  col2im(dcol) -> dx
G > 1 only where one image gives a skinny GEMM (late layers at 8x8 and below): BLAS runs
wide GEMMs much faster, and the gather/scatter copies cost little next to K-deep products.

The products with w (forward, input grad) run on dynar's panel GEMM (include/panel_gemm.h)
where the build has the vector width it was measured at: w, or w^T, is packed once per call
and every image's col is read where im2col wrote it, where a BLAS GEMM per image would pack
both again (set_panel_gemm switches; the weight gradient stays on BLAS, whose operands are
both new every image).

Parallelism: `prange` over image groups, one BLAS thread per OpenMP thread, thread-private
im2col buffers. Weight and bias gradients go to per-thread partial sums (the weight
gradient as dw^T) that are added to dw and db in fixed thread order afterwards (parallel over
output channels), so a run is deterministic for a given thread count.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.string cimport memcpy, memset
cimport numpy as cnp
cimport openmp

from _blas cimport gemm
from _panels cimport (PANEL_GEMM_PREFERRED, Weights, pack_panel, panel_size, panels_to_pack,
                      times_weights, weights_operand)
from _scratch cimport Scratch, scratch_give, scratch_take
from _tap_range cimport tap_end_valid, tap_first_valid
from _convargs cimport check_conv_backward, check_conv_forward, conv_output_shape
from _validate cimport F32, FloatKind, check_blas_dim, check_pair, data

cnp.import_array()

cdef Scratch _scratch   # im2col tiles and weight-gradient partials, reused across calls

# Columns (images x output pixels) per GEMM below which images are batched together.
DEF GEMM_MIN_COLUMNS = 256
# Bytes of the im2col tile unfolded at once when one image is large (about half an L2).
DEF COL_TILE_BYTES = 512 * 1024


cdef bint _panels_enabled = PANEL_GEMM_PREFERRED


def set_panel_gemm(bint enabled):
    """Whether the products with the weights run on dynar's panel GEMM (True) or on BLAS;
    returns the previous setting. The default is the panel GEMM where the build targets
    AVX-512, the width it was measured at."""
    global _panels_enabled
    previous = _panels_enabled
    _panels_enabled = enabled
    return previous


cdef inline Py_ssize_t _panel_elements(const ConvShape* s) noexcept nogil:
    """Scratch for the panels of w or w^T (the same size either way up to padding)."""
    cdef Py_ssize_t a = panel_size(s.Co, s.K), b = panel_size(s.K, s.Co)
    return (a if a > b else b) if _panels_enabled else 0


cdef extern from "plane_rows.h" nogil:
    void prefetch_bytes(const void* p, Py_ssize_t bytes)
    void rows_unfold_f(float* dst, const float* src, Py_ssize_t rows, Py_ssize_t ld,
                       Py_ssize_t wo, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step)
    void rows_unfold_d(double* dst, const double* src, Py_ssize_t rows, Py_ssize_t ld,
                       Py_ssize_t wo, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step)
    void rows_fold_add_f(float* dst, const float* src, Py_ssize_t rows, Py_ssize_t ld,
                         Py_ssize_t wo, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step)
    void rows_fold_add_d(double* dst, const double* src, Py_ssize_t rows, Py_ssize_t ld,
                         Py_ssize_t wo, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step)


cdef inline void _valid_rows(const ConvShape* s, Py_ssize_t i, Py_ssize_t oh0, Py_ssize_t oh1,
                             Py_ssize_t* top, Py_ssize_t* bottom) noexcept nogil:
    """Output rows [top, bottom) of [oh0, oh1) that kernel row i reads from a real input
    row; the others read padding."""
    cdef Py_ssize_t t = tap_first_valid(s.ph, i, s.sh, s.Ho)
    cdef Py_ssize_t b = tap_end_valid(s.ph, i, s.sh, s.H, s.Ho)
    t = oh0 if t < oh0 else (oh1 if t > oh1 else t)
    top[0] = t
    bottom[0] = t if b < t else (oh1 if b > oh1 else b)


cdef inline void _valid_columns(const ConvShape* s, Py_ssize_t j, Py_ssize_t* lo,
                                Py_ssize_t* hi) noexcept nogil:
    """Output columns [lo, hi) that kernel column j reads from a real input column."""
    lo[0] = tap_first_valid(s.pw, j, s.sw, s.Wo)
    hi[0] = tap_end_valid(s.pw, j, s.sw, s.W, s.Wo)
    if hi[0] < lo[0]:
        hi[0] = lo[0]


cdef void im2col(floating* col, Py_ssize_t ld, const floating* x, const ConvShape* s,
                 Py_ssize_t oh0, Py_ssize_t oh1) noexcept nogil:
    """col: (K, ld), columns [0, (oh1-oh0)*Wo) written; x: (C, H, W), one image.

    Unfolds output rows [oh0, oh1). The padding ranges are computed up front, rows and
    columns, so the inner loops are plain copies and fills instead of a bounds test per
    pixel."""
    cdef Py_ssize_t c, i, j, lo, hi, top, bottom
    cdef floating* dst
    cdef const floating* src
    # The input rows the tile reads, which the next channel's are fetched ahead of.
    cdef Py_ssize_t first_row = oh0 * s.sh - s.ph, end_row = (oh1 - 1) * s.sh - s.ph + s.kh
    first_row = first_row if first_row > 0 else 0
    end_row = end_row if end_row < s.H else s.H
    for c in range(s.C):
        if c + 1 < s.C and end_row > first_row:
            prefetch_bytes(x + ((c + 1) * s.H + first_row) * s.W,
                           (end_row - first_row) * s.W * sizeof(floating))
        for i in range(s.kh):
            _valid_rows(s, i, oh0, oh1, &top, &bottom)
            for j in range(s.kw):
                _valid_columns(s, j, &lo, &hi)
                dst = col + ((c * s.kh + i) * s.kw + j) * ld
                memset(dst, 0, (top - oh0) * s.Wo * sizeof(floating))
                dst += (top - oh0) * s.Wo
                src = x + (c * s.H + top * s.sh - s.ph + i) * s.W + lo * s.sw - s.pw + j
                if floating is float:
                    rows_unfold_f(dst, src, bottom - top, s.sh * s.W, s.Wo, lo, hi, s.sw)
                else:
                    rows_unfold_d(dst, src, bottom - top, s.sh * s.W, s.Wo, lo, hi, s.sw)
                dst += (bottom - top) * s.Wo
                memset(dst, 0, (oh1 - bottom) * s.Wo * sizeof(floating))


cdef void col2im_add(floating* x, const floating* col, Py_ssize_t ld, const ConvShape* s,
                     Py_ssize_t oh0, Py_ssize_t oh1) noexcept nogil:
    """x: (C, H, W) += every column of col (K, ld) for output rows [oh0, oh1), added back
    to the pixel im2col read it from (the adjoint of im2col)."""
    cdef Py_ssize_t c, i, j, lo, hi, top, bottom
    cdef const floating* src
    cdef floating* dst
    for c in range(s.C):
        for i in range(s.kh):
            _valid_rows(s, i, oh0, oh1, &top, &bottom)
            for j in range(s.kw):
                _valid_columns(s, j, &lo, &hi)
                src = col + ((c * s.kh + i) * s.kw + j) * ld + (top - oh0) * s.Wo
                dst = x + (c * s.H + top * s.sh - s.ph + i) * s.W + lo * s.sw - s.pw + j
                if floating is float:
                    rows_fold_add_f(dst, src, bottom - top, s.sh * s.W, s.Wo, lo, hi, s.sw)
                else:
                    rows_fold_add_d(dst, src, bottom - top, s.sh * s.W, s.Wo, lo, hi, s.sw)


cdef inline bint _is_pointwise(const ConvShape* s, Py_ssize_t gn) noexcept nogil:
    # A single image of a 1x1, stride-1, unpadded conv is its own GEMM operand.
    return s.pointwise and gn == 1


cdef inline Py_ssize_t operand_stride(const ConvShape* s, Py_ssize_t gn,
                                      Py_ssize_t cols) noexcept nogil:
    """Row stride of the operand unfold() returns."""
    return s.P if _is_pointwise(s, gn) else cols


cdef const floating* unfold(floating* col, const floating* x, const ConvShape* s,
                            Py_ssize_t n0, Py_ssize_t gn, Py_ssize_t oh0,
                            Py_ssize_t oh1) noexcept nogil:
    """The GEMM operand (K, cols) for images [n0, n0+gn), output rows [oh0, oh1): im2col
    into col, or the image itself where _is_pointwise."""
    cdef Py_ssize_t g, cols = gn * (oh1 - oh0) * s.Wo
    if _is_pointwise(s, gn):
        return x + n0 * s.C * s.P + oh0 * s.Wo
    for g in range(gn):
        im2col(col + g * (oh1 - oh0) * s.Wo, cols, x + (n0 + g) * s.C * s.H * s.W, s, oh0, oh1)
    return col


cdef struct ConvShape:
    Py_ssize_t N, C, H, W, Co, kh, kw, sh, sw, ph, pw, Ho, Wo
    Py_ssize_t K       # C*kh*kw, rows of col
    Py_ssize_t P       # Ho*Wo, columns of col per image
    Py_ssize_t G       # images per GEMM (> 1 only for small P)
    Py_ssize_t R       # output rows per GEMM when G == 1 (a tile of col that stays in cache)
    bint pointwise     # 1x1, stride 1, no padding: col is the image itself, no unfolding


cdef inline Py_ssize_t _images_per_gemm(Py_ssize_t P, Py_ssize_t N, int threads) noexcept nogil:
    cdef Py_ssize_t g = (GEMM_MIN_COLUMNS + P - 1) // P
    cdef Py_ssize_t per_thread = (N + threads - 1) // threads   # keep every thread busy
    if g > per_thread:
        g = per_thread
    return g if g >= 1 else 1


cdef inline Py_ssize_t _rows_per_tile(Py_ssize_t K, Py_ssize_t Wo, Py_ssize_t Ho,
                                      size_t itemsize) noexcept nogil:
    # Unfold only as many output rows as keep the col tile within COL_TILE_BYTES, so the
    # GEMM reads col from cache right after im2col wrote it; but never fewer columns than
    # GEMM_MIN_COLUMNS, below which BLAS runs a skinny, slow GEMM.
    cdef Py_ssize_t r = COL_TILE_BYTES // (K * Wo * <Py_ssize_t> itemsize)
    cdef Py_ssize_t r_min = (GEMM_MIN_COLUMNS + Wo - 1) // Wo
    if r < r_min:
        r = r_min
    return r if r < Ho else Ho


cdef ConvShape _conv_shape(tuple xs, tuple ws, tuple stride, tuple padding, int threads,
                           size_t itemsize) except *:
    cdef ConvShape s
    s.N, s.C, s.H, s.W = xs
    s.Co, s.kh, s.kw = ws[0], ws[2], ws[3]
    s.sh, s.sw = stride
    s.ph, s.pw = padding
    s.Ho = (s.H + 2 * s.ph - s.kh) // s.sh + 1
    s.Wo = (s.W + 2 * s.pw - s.kw) // s.sw + 1
    s.K = s.C * s.kh * s.kw
    s.P = s.Ho * s.Wo
    s.G = _images_per_gemm(s.P, s.N, threads)
    s.pointwise = s.kh == 1 and s.kw == 1 and s.sh == 1 and s.sw == 1 and s.ph == 0 and s.pw == 0
    s.R = s.Ho if s.G > 1 or s.pointwise else _rows_per_tile(s.K, s.Wo, s.Ho, itemsize)
    check_blas_dim("conv: C_in*kh*kw", s.K)
    check_blas_dim("conv: C_out", s.Co)
    check_blas_dim("conv: images*H_out*W_out per GEMM", s.G * s.P)
    return s


cdef ConvShape _plan(object xa, object wa, object stride, object padding, FloatKind kind,
                     int* threads) except *:
    """The validated shape and GEMM blocking of a call, and how many threads it can use."""
    threads[0] = openmp.omp_get_max_threads()
    cdef ConvShape s = _conv_shape(xa.shape, wa.shape, check_pair("stride", stride, 1),
                                   check_pair("padding", padding, 0), threads[0],
                                   4 if kind == F32 else 8)
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    if threads[0] > groups:
        threads[0] = <int> groups
    return s


cdef inline Py_ssize_t _workspace_per_thread(const ConvShape* s) noexcept nogil:
    # col tile, plus (for grouped images) the gathered output / output-gradient buffer
    cdef Py_ssize_t tile = s.K * s.G * s.R * s.Wo
    return tile + (s.Co * s.G * s.P if s.G > 1 else 0)


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0):
    """(N, C_out, H_out, W_out) of conv2d_forward, or ValueError naming what is wrong.

    x_shape: (N, C_in, H, W); w_shape: (C_out, C_in, kh, kw)."""
    return conv_output_shape(x_shape, w_shape, stride, padding)


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   ConvShape s, floating* work, Py_ssize_t work_per_thread,
                   int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t grp, n0, g, gn, co, p, oh0, oh1, cols, ld_col, ld_out
    cdef floating* col = NULL
    cdef floating* gathered = NULL
    cdef floating* out
    cdef const floating* colp
    cdef Weights a = weights_operand(s.Co, s.K, False, (work + threads * work_per_thread)
                                     if _panels_enabled else NULL)
    # Parallel over image groups: every group is an independent GEMM writing its own
    # images, so threads never wait on each other.
    with parallel(num_threads=threads):
        for p in prange(panels_to_pack(&a), schedule="static"):
            pack_panel(&a, w, p)
        col = work + threadid() * work_per_thread
        gathered = col + s.K * s.G * s.R * s.Wo
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            oh0 = 0
            while oh0 < s.Ho:
                oh1 = oh0 + s.R if oh0 + s.R < s.Ho else s.Ho
                cols = gn * (oh1 - oh0) * s.Wo
                # (ld_col is assigned here, not through a pointer, so that prange keeps it
                # private to each thread.)
                ld_col = operand_stride(&s, gn, cols)
                colp = unfold(col, x, &s, n0, gn, oh0, oh1)
                # One image: GEMM straight into y[n]; several: into a buffer, then scatter.
                if gn == 1:
                    out = y + n0 * s.Co * s.P + oh0 * s.Wo
                    ld_out = s.P
                else:
                    out = gathered
                    ld_out = cols
                times_weights(out, ld_out, &a, w, colp, ld_col, cols, b)
                if gn > 1:
                    for g in range(gn):
                        for co in range(s.Co):
                            memcpy(y + ((n0 + g) * s.Co + co) * s.P,
                                   gathered + co * cols + g * s.P, s.P * sizeof(floating))
                oh0 = oh1


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, ConvShape s,
                    floating* work, Py_ssize_t work_per_thread, floating* partials,
                    int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t wsize = s.Co * s.K
    cdef Py_ssize_t slot = wsize + s.Co
    cdef Py_ssize_t grp, n0, g, gn, co, p, oh0, oh1, cols, ld_col, ld_dy, t, kk
    cdef floating* col = NULL
    cdef floating* gathered = NULL
    cdef floating* dwt = NULL
    cdef floating* dbt = NULL
    cdef const floating* colp
    cdef const floating* dyp
    cdef floating acc
    cdef Weights a = weights_operand(s.Co, s.K, True, (partials + threads * slot)
                                     if _panels_enabled else NULL)
    # Every thread sums its images' gradients in a zeroed slot of partials: the weight
    # gradient transposed, dw^T (K, C_out), then the bias gradient. Asked for dw^T, BLAS
    # packs col as it lies instead of transposing it: the backward pass of ResNet's stride-2
    # layers ran 5% faster.
    memset(partials, 0, threads * slot * sizeof(floating))
    # Parallel over image groups, as forward; input gradients go to the group's own images.
    with parallel(num_threads=threads):
        for p in prange(panels_to_pack(&a) if dx != NULL else 0, schedule="static"):
            pack_panel(&a, w, p)
        col = work + threadid() * work_per_thread
        gathered = col + s.K * s.G * s.R * s.Wo
        dwt = partials + threadid() * slot
        dbt = dwt + wsize
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            if dx != NULL and not _is_pointwise(&s, gn):
                memset(dx + n0 * s.C * s.H * s.W, 0, gn * s.C * s.H * s.W * sizeof(floating))
            oh0 = 0
            while oh0 < s.Ho:
                oh1 = oh0 + s.R if oh0 + s.R < s.Ho else s.Ho
                cols = gn * (oh1 - oh0) * s.Wo
                if gn == 1:
                    dyp = dy + n0 * s.Co * s.P + oh0 * s.Wo
                    ld_dy = s.P
                else:
                    for g in range(gn):
                        for co in range(s.Co):
                            memcpy(gathered + co * cols + g * s.P,
                                   dy + ((n0 + g) * s.Co + co) * s.P, s.P * sizeof(floating))
                    dyp = gathered
                    ld_dy = cols
                # (ld_col is assigned here, not through a pointer, so that prange keeps it
                # private to each thread.)
                ld_col = operand_stride(&s, gn, cols)
                colp = unfold(col, x, &s, n0, gn, oh0, oh1)
                gemm(False, True, <int> s.K, <int> s.Co, <int> cols, <floating> 1, colp,
                     <int> ld_col, dyp, <int> ld_dy, <floating> 1, dwt, <int> s.Co)
                if db != NULL:
                    for co in range(s.Co):
                        acc = 0
                        for p in range(cols):
                            acc = acc + dyp[co * ld_dy + p]
                        dbt[co] += acc
                if dx != NULL:
                    if _is_pointwise(&s, gn):
                        # 1x1 stride 1: the input gradient is the GEMM itself, no col2im.
                        times_weights(dx + n0 * s.C * s.P + oh0 * s.Wo, s.P, &a, w, dyp,
                                       ld_dy, cols, NULL)
                    else:
                        # dcol overwrites col: the weight-gradient GEMM above consumed it.
                        times_weights(col, cols, &a, w, dyp, ld_dy, cols, NULL)
                        for g in range(gn):
                            col2im_add(dx + (n0 + g) * s.C * s.H * s.W,
                                       col + g * (oh1 - oh0) * s.Wo, cols, &s, oh0, oh1)
                oh0 = oh1
    # Add the threads' sums in fixed thread order, parallel over output channels.
    for co in prange(s.Co, schedule="static", num_threads=threads, nogil=True):
        for kk in range(s.K):
            acc = 0
            for t in range(threads):
                acc = acc + partials[t * slot + kk * s.Co + co]
            dw[co * s.K + kk] += acc
        if db != NULL:
            acc = 0
            for t in range(threads):
                acc = acc + partials[t * slot + wsize + co]
            db[co] += acc


def conv2d_forward(y, x, w, b=None, stride=1, padding=0):
    """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, kh, kw)) + b (C_out,).

    y is overwritten. b may be None. stride, padding: int or (h, w)."""
    cdef FloatKind kind = F32
    ya, xa, wa, ba = check_conv_forward(y, x, w, b, stride, padding, &kind)
    cdef int threads
    cdef ConvShape s = _plan(xa, wa, stride, padding, kind, &threads)
    cdef Py_ssize_t per_thread = _workspace_per_thread(&s)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef bint private
    cdef void* work = scratch_take(
        &_scratch, (threads * per_thread + _panel_elements(&s)) * itemsize, &private)
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
        scratch_give(&_scratch, work, private)


def conv2d_backward(dx, dw, db, dy, x, w, stride=1, padding=0):
    """Gradients of conv2d_forward given dy (N, C_out, H_out, W_out).

    dx (N, C_in, H, W) is overwritten (None skips the input gradient, as for a first layer);
    dw (C_out, C_in, kh, kw) and db (C_out,) are accumulated into (+=); db may be None."""
    cdef FloatKind kind = F32
    dxa, dwa, dba, dya, xa, wa = check_conv_backward(dx, dw, db, dy, x, w, stride, padding,
                                                     &kind)
    cdef int threads
    cdef ConvShape s = _plan(xa, wa, stride, padding, kind, &threads)
    cdef Py_ssize_t per_thread = _workspace_per_thread(&s)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t partial_size = threads * (s.Co * s.K + s.Co)
    cdef bint private
    cdef void* work = scratch_take(
        &_scratch, (threads * per_thread + partial_size + _panel_elements(&s)) * itemsize,
        &private)
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
        scratch_give(&_scratch, work, private)
