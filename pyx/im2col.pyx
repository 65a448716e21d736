"""2-D convolution by im2col + GEMM: forward, weight/bias gradient, input gradient.

Layout (as Caffe's base_conv_layer): for a group of G images, im2col unfolds the input into
col (K, G*P) with K = C_in*kh*kw rows and P = H_out*W_out output pixels per image; then
    forward:      out (C_out, G*P) = w (C_out, K) @ col (K, G*P)          [+ bias]
    weight grad:  dw^T (K, C_out) += col (K, G*P) @ dy^T (G*P, C_out)
    bias grad:    db (C_out,)     += the row sums of dy (C_out, G*P)
    input grad:   dcol (K, G*P)    = w^T (K, C_out) @ dy (C_out, G*P);  col2im(dcol) -> dx
G > 1 only where one image gives a skinny GEMM (late layers at 8x8 and below): BLAS runs wide
GEMMs much faster, and the gather/scatter copies cost little next to K-deep products.

The products with w (forward, input grad) run on dynar's panel GEMM (include/panel_gemm.h)
unless conv.set_panel_gemm says BLAS: w, or w^T, is packed once per call and each image's col
only a strip at a time into L1, where a BLAS GEMM per image would pack both whole again. The
weight gradient stays on BLAS, whose operands are both new every image; asked for dw^T, BLAS
packs col as it lies instead of transposing it (docs/notes/2026-12-02-kernels.md).

Parallelism: `prange` over image groups, one BLAS thread per OpenMP thread, thread-private
im2col buffers. Weight and bias gradients go to per-thread partial sums that are added to dw
and db in fixed thread order afterwards (parallel over output channels), so a run is
deterministic for a given thread count.

Entry points: `forward`, `backward`, `supports` (conv.Algorithm); any kernel, stride and
padding.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.stdint cimport uint16_t
from libc.string cimport memcpy, memset
cimport numpy as cnp

from _blas cimport gemm
from _conv_call cimport ConvAlgorithm, ConvCall, ConvGeometry, algorithm_capsule
from _panels cimport (Weights, bf16_gemm_nt, bf16_panel_size, pack_panel, panel_size,
                      panels_to_pack, times_weights, weights_operand)
from _lane_sums cimport runs_sum
from _parallel cimport threads_for
from _tap_range cimport tap_end_valid, tap_first_valid
from _validate cimport F32, check_blas_dim

from dynar.kernels import conv

cnp.import_array()

# Columns (images x output pixels) per GEMM below which images are batched together.
DEF GEMM_MIN_COLUMNS = 256
# Bytes of the im2col tile unfolded at once when one image is large (about half an L2).
DEF COL_TILE_BYTES = 512 * 1024


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


cdef struct Im2colPlan:
    ConvGeometry g
    Py_ssize_t K           # C*kh*kw, rows of col
    Py_ssize_t P           # Ho*Wo, columns of col per image
    Py_ssize_t G           # images per GEMM (> 1 only for small P)
    Py_ssize_t R           # output rows per GEMM when G == 1 (a tile of col that stays in cache)
    bint pointwise         # 1x1, stride 1, no padding: col is the image itself, no unfolding
    Py_ssize_t panels      # the products with w on the panel GEMM (ConvCall.panel_block), 0: BLAS
    int bf16               # ... on its bf16 panels and this kernel (ConvCall.bf16)
    int threads
    Py_ssize_t tile        # a thread's col tile: K * G * R * Wo
    Py_ssize_t per_thread  # the tile, then (grouped images) the group's output or its gradient,
                           # then (bf16 backward) the weight gradient's packed col
    Py_ssize_t packed_col  # where in a thread's slot the last starts


# ---- im2col and col2im ----

cdef inline void _valid_rows(const ConvGeometry* g, Py_ssize_t i, Py_ssize_t oh0,
                             Py_ssize_t oh1, Py_ssize_t* top, Py_ssize_t* bottom) noexcept nogil:
    """Output rows [top, bottom) of [oh0, oh1) that kernel row i reads from a real input
    row; the others read padding."""
    cdef Py_ssize_t t = tap_first_valid(g.ph, i, g.sh, g.Ho)
    cdef Py_ssize_t b = tap_end_valid(g.ph, i, g.sh, g.H, g.Ho)
    t = oh0 if t < oh0 else (oh1 if t > oh1 else t)
    top[0] = t
    bottom[0] = t if b < t else (oh1 if b > oh1 else b)


cdef inline void _valid_columns(const ConvGeometry* g, Py_ssize_t j, Py_ssize_t* lo,
                                Py_ssize_t* hi) noexcept nogil:
    """Output columns [lo, hi) that kernel column j reads from a real input column."""
    lo[0] = tap_first_valid(g.pw, j, g.sw, g.Wo)
    hi[0] = tap_end_valid(g.pw, j, g.sw, g.W, g.Wo)
    if hi[0] < lo[0]:
        hi[0] = lo[0]


cdef void im2col(floating* col, Py_ssize_t ld, const floating* x, const ConvGeometry* g,
                 Py_ssize_t oh0, Py_ssize_t oh1) noexcept nogil:
    """col: (K, ld), columns [0, (oh1-oh0)*Wo) written; x: (C, H, W), one image.

    Unfolds output rows [oh0, oh1). The padding ranges are computed up front, rows and
    columns, so the inner loops are plain copies and fills instead of a bounds test per
    pixel."""
    cdef Py_ssize_t c, i, j, lo, hi, top, bottom
    cdef floating* dst
    cdef const floating* src
    # The input rows the tile reads, which the next channel's are fetched ahead of.
    cdef Py_ssize_t first_row = oh0 * g.sh - g.ph, end_row = (oh1 - 1) * g.sh - g.ph + g.kh
    first_row = first_row if first_row > 0 else 0
    end_row = end_row if end_row < g.H else g.H
    for c in range(g.C):
        if c + 1 < g.C and end_row > first_row:
            prefetch_bytes(x + ((c + 1) * g.H + first_row) * g.W,
                           (end_row - first_row) * g.W * sizeof(floating))
        for i in range(g.kh):
            _valid_rows(g, i, oh0, oh1, &top, &bottom)
            for j in range(g.kw):
                _valid_columns(g, j, &lo, &hi)
                dst = col + ((c * g.kh + i) * g.kw + j) * ld
                memset(dst, 0, (top - oh0) * g.Wo * sizeof(floating))
                dst += (top - oh0) * g.Wo
                src = x + (c * g.H + top * g.sh - g.ph + i) * g.W + lo * g.sw - g.pw + j
                if floating is float:
                    rows_unfold_f(dst, src, bottom - top, g.sh * g.W, g.Wo, lo, hi, g.sw)
                else:
                    rows_unfold_d(dst, src, bottom - top, g.sh * g.W, g.Wo, lo, hi, g.sw)
                dst += (bottom - top) * g.Wo
                memset(dst, 0, (oh1 - bottom) * g.Wo * sizeof(floating))


cdef void col2im_add(floating* x, const floating* col, Py_ssize_t ld, const ConvGeometry* g,
                     Py_ssize_t oh0, Py_ssize_t oh1) noexcept nogil:
    """x: (C, H, W) += every column of col (K, ld) for output rows [oh0, oh1), added back
    to the pixel im2col read it from (the adjoint of im2col)."""
    cdef Py_ssize_t c, i, j, lo, hi, top, bottom
    cdef const floating* src
    cdef floating* dst
    for c in range(g.C):
        for i in range(g.kh):
            _valid_rows(g, i, oh0, oh1, &top, &bottom)
            for j in range(g.kw):
                _valid_columns(g, j, &lo, &hi)
                src = col + ((c * g.kh + i) * g.kw + j) * ld + (top - oh0) * g.Wo
                dst = x + (c * g.H + top * g.sh - g.ph + i) * g.W + lo * g.sw - g.pw + j
                if floating is float:
                    rows_fold_add_f(dst, src, bottom - top, g.sh * g.W, g.Wo, lo, hi, g.sw)
                else:
                    rows_fold_add_d(dst, src, bottom - top, g.sh * g.W, g.Wo, lo, hi, g.sw)


# ---- The GEMM operands of a group of images ----

cdef inline bint _is_pointwise(const Im2colPlan* s, Py_ssize_t gn) noexcept nogil:
    # A single image of a 1x1, stride-1, unpadded conv is its own GEMM operand.
    return s.pointwise and gn == 1


cdef inline Py_ssize_t _operand_stride(const Im2colPlan* s, Py_ssize_t gn,
                                       Py_ssize_t cols) noexcept nogil:
    """Row stride of the operand _unfold returns."""
    return s.P if _is_pointwise(s, gn) else cols


cdef const floating* _unfold(floating* col, const floating* x, const Im2colPlan* s,
                             Py_ssize_t n0, Py_ssize_t gn, Py_ssize_t oh0,
                             Py_ssize_t oh1) noexcept nogil:
    """The GEMM operand (K, cols) for images [n0, n0+gn), output rows [oh0, oh1): im2col
    into col, or the image itself where _is_pointwise."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t i, cols = gn * (oh1 - oh0) * g.Wo
    if _is_pointwise(s, gn):
        return x + n0 * g.C * s.P + oh0 * g.Wo
    for i in range(gn):
        im2col(col + i * (oh1 - oh0) * g.Wo, cols, x + (n0 + i) * g.C * g.H * g.W, g, oh0, oh1)
    return col


cdef void _regroup(floating* dst, const floating* src, const Im2colPlan* s, Py_ssize_t n0,
                   Py_ssize_t gn, bint to_group) noexcept nogil:
    """Between images [n0, n0+gn) of an output-shaped array (N, C_out, P) and one GEMM's
    layout of their group (C_out, gn*P): to the group if to_group, else back."""
    cdef Py_ssize_t i, co, image_at, group_at
    for i in range(gn):
        for co in range(s.g.Co):
            image_at = ((n0 + i) * s.g.Co + co) * s.P
            group_at = co * gn * s.P + i * s.P
            if to_group:
                memcpy(dst + group_at, src + image_at, s.P * sizeof(floating))
            else:
                memcpy(dst + image_at, src + group_at, s.P * sizeof(floating))


# ---- Plan ----

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


cdef inline Py_ssize_t _panel_elements(const Im2colPlan* s) noexcept nogil:
    """Workspace for the panels of w or w^T (the same size either way up to padding), in
    elements (a float holds two halves of bf16 panels)."""
    cdef Py_ssize_t a = panel_size(s.g.Co, s.K), b = panel_size(s.K, s.g.Co)
    if s.bf16:
        a = (bf16_panel_size(s.g.Co, s.K) + 1) // 2
        b = (bf16_panel_size(s.K, s.g.Co) + 1) // 2
    return (a if a > b else b) if s.panels else 0


cdef inline Py_ssize_t _partials_slot(const Im2colPlan* s) noexcept nogil:
    """One thread's partial sums in backward: dw^T (K, C_out), then db (C_out,)."""
    return s.K * s.g.Co + s.g.Co


cdef Py_ssize_t _plan(const ConvCall* c, void* plan) except -1:
    # Workspace: every thread's tile (per_thread), then in backward their partial sums, then
    # the panels of w or w^T.
    cdef Im2colPlan* s = <Im2colPlan*> plan
    cdef const ConvGeometry* g = &c.g
    cdef size_t itemsize = 4 if c.kind == F32 else 8
    s.g = c.g
    s.K = g.C * g.kh * g.kw
    s.P = g.Ho * g.Wo
    s.G = _images_per_gemm(s.P, g.N, threads_for(g.N))
    s.pointwise = g.kh == 1 and g.kw == 1 and g.sh == 1 and g.sw == 1 and g.ph == 0 and g.pw == 0
    s.R = g.Ho if s.G > 1 or s.pointwise else _rows_per_tile(s.K, g.Wo, g.Ho, itemsize)
    check_blas_dim("im2col: C_in*kh*kw", s.K)
    check_blas_dim("im2col: C_out", g.Co)
    check_blas_dim("im2col: images*H_out*W_out per GEMM", s.G * s.P)
    s.panels = c.panel_block
    s.bf16 = c.bf16
    s.threads = threads_for((g.N + s.G - 1) // s.G)
    s.tile = s.K * s.G * s.R * g.Wo
    s.packed_col = s.tile + (g.Co * s.G * s.P if s.G > 1 else 0)
    s.per_thread = s.packed_col
    if c.backward and s.bf16:
        s.per_thread += (bf16_panel_size(s.K, s.G * s.R * g.Wo) + 1) // 2
    cdef Py_ssize_t elements = s.threads * s.per_thread + _panel_elements(s)
    if c.backward:
        elements += s.threads * _partials_slot(s)
    return elements * itemsize


# ---- Forward ----

cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   const void* plan, floating* work) noexcept nogil:
    cdef const Im2colPlan* s = <const Im2colPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t groups = (g.N + s.G - 1) // s.G
    cdef Py_ssize_t grp, n0, gn, p, oh0, oh1, cols, ld_col, ld_out
    cdef floating* col = NULL
    cdef floating* grouped = NULL
    cdef floating* out
    cdef const floating* colp
    cdef Weights a = weights_operand(g.Co, s.K, False, (work + s.threads * s.per_thread)
                                     if s.panels else NULL, s.panels, s.bf16)
    # Parallel over image groups: every group is an independent GEMM writing its own
    # images, so threads never wait on each other.
    with parallel(num_threads=s.threads):
        for p in prange(panels_to_pack(&a), schedule="static"):
            pack_panel(&a, w, p)
        col = work + threadid() * s.per_thread
        grouped = col + s.tile
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= g.N else g.N - n0
            oh0 = 0
            while oh0 < g.Ho:
                oh1 = oh0 + s.R if oh0 + s.R < g.Ho else g.Ho
                cols = gn * (oh1 - oh0) * g.Wo
                # (ld_col is assigned here, not through a pointer, so that prange keeps it
                # private to each thread.)
                ld_col = _operand_stride(s, gn, cols)
                colp = _unfold(col, x, s, n0, gn, oh0, oh1)
                # One image: GEMM straight into y[n]; several: into the group's buffer.
                if gn == 1:
                    out = y + n0 * g.Co * s.P + oh0 * g.Wo
                    ld_out = s.P
                else:
                    out = grouped
                    ld_out = cols
                times_weights(out, ld_out, &a, w, colp, ld_col, cols, b)
                if gn > 1:
                    _regroup(y, grouped, s, n0, gn, False)
                oh0 = oh1


# ---- Backward, in Caffe's stages: weight, bias and input gradient per tile of images, then
# the reduction of the threads' partial sums ----

cdef inline void _weight_gradient(floating* dwt, const floating* col, Py_ssize_t ld_col,
                                  const floating* dy, Py_ssize_t ld_dy, Py_ssize_t cols,
                                  const Im2colPlan* s, floating* packed) noexcept nogil:
    """dw^T (K, C_out) += col (K, cols) @ dy^T (cols, C_out); in bf16, col packed into
    `packed` as it is rounded."""
    if floating is float and s.bf16:
        bf16_gemm_nt(s.bf16, dwt, s.g.Co, col, ld_col, s.K, dy, ld_dy, s.g.Co, cols,
                     <uint16_t*> packed, s.panels, True)
        return
    gemm(False, True, <int> s.K, <int> s.g.Co, <int> cols, <floating> 1, col, <int> ld_col,
         dy, <int> ld_dy, <floating> 1, dwt, <int> s.g.Co)


cdef inline void _bias_gradient(floating* db, const floating* dy, Py_ssize_t ld_dy,
                                Py_ssize_t cols, Py_ssize_t Co) noexcept nogil:
    """db (C_out,) += the row sums of dy (C_out, cols)."""
    cdef Py_ssize_t co
    for co in range(Co):
        db[co] += <floating> runs_sum(dy + co * ld_dy, 1, 0, cols)


cdef inline void _input_gradient(floating* dx, floating* col, const Weights* a,
                                 const floating* w, const floating* dy, Py_ssize_t ld_dy,
                                 const Im2colPlan* s, Py_ssize_t n0, Py_ssize_t gn,
                                 Py_ssize_t oh0, Py_ssize_t oh1, Py_ssize_t cols) noexcept nogil:
    """dx of images [n0, n0+gn) += col2im(w^T @ dy) for output rows [oh0, oh1); col is the
    tile's, which the weight gradient is done with."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t i
    if _is_pointwise(s, gn):
        # 1x1 stride 1: the input gradient is the GEMM itself, no col2im.
        times_weights(dx + n0 * g.C * s.P + oh0 * g.Wo, s.P, a, w, dy, ld_dy, cols, NULL)
        return
    times_weights(col, cols, a, w, dy, ld_dy, cols, NULL)
    for i in range(gn):
        col2im_add(dx + (n0 + i) * g.C * g.H * g.W, col + i * (oh1 - oh0) * g.Wo, cols, g,
                   oh0, oh1)


cdef void _reduce_partials(floating* dw, floating* db, const floating* partials,
                           const Im2colPlan* s) noexcept nogil:
    """dw (C_out, K) += the threads' dw^T, db += their bias sums, added in fixed thread order
    (parallel over output channels)."""
    cdef Py_ssize_t slot = _partials_slot(s), co, k
    cdef int t
    cdef floating acc
    for co in prange(s.g.Co, schedule="static", num_threads=s.threads, nogil=True):
        for k in range(s.K):
            acc = 0
            for t in range(s.threads):
                acc = acc + partials[t * slot + k * s.g.Co + co]
            dw[co * s.K + k] += acc
        if db != NULL:
            acc = 0
            for t in range(s.threads):
                acc = acc + partials[t * slot + s.K * s.g.Co + co]
            db[co] += acc


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, const void* plan,
                    floating* work) noexcept nogil:
    cdef const Im2colPlan* s = <const Im2colPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t groups = (g.N + s.G - 1) // s.G
    cdef Py_ssize_t slot = _partials_slot(s)
    cdef floating* partials = work + s.threads * s.per_thread
    cdef Py_ssize_t grp, n0, gn, p, oh0, oh1, cols, ld_col, ld_dy
    cdef floating* col = NULL
    cdef floating* grouped = NULL
    cdef floating* dwt = NULL
    cdef const floating* colp
    cdef const floating* dyp
    cdef Weights a = weights_operand(g.Co, s.K, True, (partials + s.threads * slot)
                                     if s.panels else NULL, s.panels, s.bf16)
    memset(partials, 0, s.threads * slot * sizeof(floating))
    # Parallel over image groups, as forward; input gradients go to the group's own images.
    with parallel(num_threads=s.threads):
        for p in prange(panels_to_pack(&a) if dx != NULL else 0, schedule="static"):
            pack_panel(&a, w, p)
        col = work + threadid() * s.per_thread
        grouped = col + s.tile
        dwt = partials + threadid() * slot
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= g.N else g.N - n0
            if dx != NULL and not _is_pointwise(s, gn):
                memset(dx + n0 * g.C * g.H * g.W, 0, gn * g.C * g.H * g.W * sizeof(floating))
            oh0 = 0
            while oh0 < g.Ho:
                oh1 = oh0 + s.R if oh0 + s.R < g.Ho else g.Ho
                cols = gn * (oh1 - oh0) * g.Wo
                if gn == 1:
                    dyp = dy + n0 * g.Co * s.P + oh0 * g.Wo
                    ld_dy = s.P
                else:
                    _regroup(grouped, dy, s, n0, gn, True)
                    dyp = grouped
                    ld_dy = cols
                # (ld_col is assigned here, not through a pointer, so that prange keeps it
                # private to each thread.)
                ld_col = _operand_stride(s, gn, cols)
                colp = _unfold(col, x, s, n0, gn, oh0, oh1)
                _weight_gradient(dwt, colp, ld_col, dyp, ld_dy, cols, s, col + s.packed_col)
                if db != NULL:
                    _bias_gradient(dwt + g.Co * s.K, dyp, ld_dy, cols, g.Co)
                if dx != NULL:
                    _input_gradient(dx, col, &a, w, dyp, ld_dy, s, n0, gn, oh0, oh1, cols)
                oh0 = oh1
    _reduce_partials(dw, db, partials, s)


cdef ConvAlgorithm _IM2COL = ConvAlgorithm(
    b"im2col", b"any kernel, stride and padding", sizeof(Im2colPlan), NULL, _plan,
    _forward[float], _forward[double], _backward[float], _backward[double])
algorithm = conv.Algorithm(algorithm_capsule(&_IM2COL))
forward, backward, supports = algorithm.forward, algorithm.backward, algorithm.supports
