"""2-D convolution as one GEMM per kernel tap, for layers on small planes: forward,
weight/bias gradient, input gradient.

On VGG's last layers (512 -> 512, 3x3, padding 1, a 2x2 plane) five ninths of an im2col
matrix are padding, and the GEMM multiplies all of them. Here each tap (i, j) is its own
product: it pairs output pixel (oh, ow) with input pixel (oh*sh + i - ph, ow*sw + j - pw), and
only pairs whose input pixel exists are multiplied (4/9 of im2col's multiply-adds on a 2x2
plane, 69% on 4x4). The batch is laid out channel-major with the image index fastest,
    x~ (C, H*W*N),  y~ (C_out, Ho*Wo*N),  w_t = w[:, :, i, j] (C_out, C),
where x~ orders a channel's pixels by stride phase (all pixels (h, w) with h % sh = a and
w % sw = b form phase (a, b)'s plane; at stride 1 that is the plane itself). Then the pairs
of a tap form runs of contiguous columns (a run: one output row's valid pixels, which read one
row segment of one phase; the tap's whole range when it spans whole rows), and per run r of
tap t:
    forward:      y~[:, r]            += w_t @ x~[:, r shifted by t]                  (+ b)
    weight grad:  dw[:, :, i, j]       += dy~[:, r] @ x~[:, r shifted by t]^T          (db: row sums)
    input grad:   dx~[:, r shifted by t] += w_t^T @ dy~[:, r]
The GEMMs are C_out x C_in deep with N to Ho*Wo*N columns, shapes BLAS runs near its peak,
where im2col's per-image GEMMs on a 2x2 plane have 4 columns. Copying the batch into and out
of that layout costs one pass over each. The weights are repacked as wt (C_out, taps, C_in),
so w_t is a matrix of row stride taps*C_in, and every output channel's repacking (and the
weight gradient's, back) is a transpose within a few kilobytes.

Parallelism: forward and weight gradient split C_out between the threads, the input gradient
splits C_in; each thread owns its rows of every product, so nothing is reduced afterwards and a
run is deterministic for a given thread count.

Entry points: `forward`, `backward`, `supports` (conv.Algorithm); any kernel, stride and
padding.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel
from libc.stdint cimport uint16_t
from libc.string cimport memset
cimport numpy as cnp

from _blas cimport gemm
from _conv_call cimport ConvAlgorithm, ConvCall, ConvGeometry, algorithm_capsule
from _panels cimport (bf16_gemm_nt, bf16_panel_count, bf16_panel_gemm, bf16_panel_offset,
                      bf16_panel_pack_taps, bf16_panel_size)
from _lane_sums cimport runs_sum
from _parallel cimport threads_for
from _tap_range cimport tap_end_valid, tap_first_valid
from _validate cimport F32, check_blas_dim

from dynar.kernels import conv

cnp.import_array()

# Rows of a thread's block are a multiple of this, so BLAS's micro-kernels see whole panels.
DEF BLOCK_ROWS = 16
# Side of the square tiles the layout changes copy.
DEF TRANSPOSE_TILE = 16
# Halves (a cache line) between one tap's bf16 panels and the next's.
DEF TAP_PANELS_PAD = 32


cdef struct TapPlan:
    ConvGeometry g
    int threads
    Py_ssize_t Hq, Wq   # a stride phase's plane: ceil(H / sh) x ceil(W / sw)
    Py_ssize_t taps     # kh*kw
    Py_ssize_t in_ld    # sh*sw*Hq*Wq*N: one input channel of x~
    Py_ssize_t out_ld   # Ho*Wo*N: one output channel of y~
    Py_ssize_t runs     # how many runs the taps have in all
    # The workspace: the runs, then from a cache line on x~, then y~ (or dy~), then w_t
    # (forward, and backward with an input gradient), dx~ (backward with one) and dw_t
    # (backward), at these offsets in elements from x~. In bf16 (ConvCall.bf16) the GEMMs
    # run on include/panel_gemm_bf16.h: w_t's room holds each tap's bf16 panels of w (or of
    # w^T for the input gradient), tap_panels halves apart, and after dw_t each thread has
    # nt_size elements for the weight gradient's packed dy~.
    size_t runs_bytes
    Py_ssize_t at_wt, at_dxt, at_dwt
    int bf16
    Py_ssize_t panel_block, tap_panels, at_nt, nt_size


cdef struct Run:
    Py_ssize_t tap      # i*kw + j
    Py_ssize_t out      # first column of the run in y~
    Py_ssize_t inp      # first column of the input pixels it pairs with in x~
    Py_ssize_t length   # columns


cdef inline Py_ssize_t _floor_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    # (the module divides the C way, truncating; a tap's offset from the padding can be < 0)
    return a // b if a >= 0 else -((-a + b - 1) // b)


cdef Py_ssize_t _list_runs(Run* runs, const TapPlan* s) noexcept nogil:
    """Write the runs of every tap, grouped by tap in tap order, to runs (unless NULL);
    return how many there are.

    Tap (i, j) reads input row oh*sh + i - ph = (oh + di)*sh + ai with 0 <= ai < sh: row
    oh + di of stride phase ai, and likewise for columns; so an output row's valid pixels
    read one contiguous row segment of one phase plane."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t n = 0, i, j, top, bottom, lo, hi, oh, di, dj, plane, inp
    cdef Py_ssize_t N = g.N
    for i in range(g.kh):
        top = tap_first_valid(g.ph, i, g.sh, g.Ho)
        bottom = tap_end_valid(g.ph, i, g.sh, g.H, g.Ho)
        di = _floor_div(i - g.ph, g.sh)
        for j in range(g.kw):
            lo = tap_first_valid(g.pw, j, g.sw, g.Wo)
            hi = tap_end_valid(g.pw, j, g.sw, g.W, g.Wo)
            if bottom <= top or hi <= lo:
                continue   # the tap reads only padding
            dj = _floor_div(j - g.pw, g.sw)
            plane = ((i - g.ph - di * g.sh) * g.sw + j - g.pw - dj * g.sw) * s.Hq * s.Wq
            if lo == 0 and hi == g.Wo and g.Wo == s.Wq:
                # Whole rows on both sides, of the same length: the rows are one run.
                if runs != NULL:
                    runs[n] = Run(i * g.kw + j, top * g.Wo * N,
                                  (plane + (top + di) * s.Wq) * N, (bottom - top) * g.Wo * N)
                n += 1
                continue
            for oh in range(top, bottom):
                if runs != NULL:
                    inp = (plane + (oh + di) * s.Wq + lo + dj) * N
                    runs[n] = Run(i * g.kw + j, (oh * g.Wo + lo) * N, inp, (hi - lo) * N)
                n += 1
    return n


cdef Py_ssize_t _plan(const ConvCall* c, void* plan) except -1:
    cdef TapPlan* s = <TapPlan*> plan
    cdef const ConvGeometry* g = &c.g
    s.g = c.g
    s.threads = threads_for(g.C if g.C > g.Co else g.Co)
    s.taps = g.kh * g.kw
    s.Hq = (g.H + g.sh - 1) // g.sh
    s.Wq = (g.W + g.sw - 1) // g.sw
    s.in_ld = g.sh * g.sw * s.Hq * s.Wq * g.N
    s.out_ld = g.Ho * g.Wo * g.N
    check_blas_dim("tapgemm: C_in", g.C)
    check_blas_dim("tapgemm: C_out", g.Co)
    check_blas_dim("tapgemm: N*H*W (in stride phases)", s.in_ld)
    check_blas_dim("tapgemm: N*H_out*W_out", s.out_ld)
    s.runs = _list_runs(NULL, s)
    s.runs_bytes = (s.runs * sizeof(Run) + 63) // 64 * 64
    cdef Py_ssize_t xt_size = g.C * s.in_ld, wt_size = s.taps * g.Co * g.C
    cdef bint with_dx = c.dx != NULL
    s.bf16 = c.bf16
    s.panel_block = c.panel_block
    # (a cache line apart, so that the taps' panels, packed together, fall in different sets)
    s.tap_panels = (bf16_panel_size(g.C, g.Co) if c.backward
                    else bf16_panel_size(g.Co, g.C)) + TAP_PANELS_PAD
    cdef Py_ssize_t wt_room = wt_size
    if s.bf16 and (s.taps * s.tap_panels + 1) // 2 > wt_room:
        wt_room = (s.taps * s.tap_panels + 1) // 2
    s.at_wt = xt_size + g.Co * s.out_ld
    s.at_dxt = s.at_wt + (wt_room if with_dx else 0)
    s.at_dwt = s.at_dxt + (xt_size if with_dx else 0)
    s.at_nt = s.at_dwt + wt_size
    s.nt_size = (bf16_panel_size(_block_start(1, s.threads, g.Co), s.out_ld) + 1) // 2
    cdef Py_ssize_t elements = (s.at_nt + (s.threads * s.nt_size if s.bf16 else 0)
                                if c.backward else s.at_wt + wt_room)
    return s.runs_bytes + elements * (4 if c.kind == F32 else 8)


cdef inline void _transpose(floating* dst, Py_ssize_t dst_ld, Py_ssize_t dst_step,
                            const floating* src, Py_ssize_t src_ld, Py_ssize_t src_step,
                            Py_ssize_t rows, Py_ssize_t cols, bint accumulate) noexcept nogil:
    """dst[c*dst_ld + r*dst_step] (=, or += if accumulate) src[r*src_ld + c*src_step] for
    r < rows, c < cols.

    Tile by tile, so that reads and writes both stay within a few cache lines per tile. Within
    a tile the side with the longer row stride is walked along its rows: the images of a batch
    lie kilobytes apart, a power of two that maps a tile's rows to one cache set, and visiting
    each such row once instead of once per column keeps them from evicting each other."""
    cdef Py_ssize_t r0, c0, r, c, r1, c1
    cdef bint along_src = src_ld > dst_ld
    for r0 in range(0, rows, TRANSPOSE_TILE):
        r1 = r0 + TRANSPOSE_TILE if r0 + TRANSPOSE_TILE < rows else rows
        for c0 in range(0, cols, TRANSPOSE_TILE):
            c1 = c0 + TRANSPOSE_TILE if c0 + TRANSPOSE_TILE < cols else cols
            if along_src:
                for r in range(r0, r1):
                    for c in range(c0, c1):
                        _put(dst + c * dst_ld + r * dst_step, src[r * src_ld + c * src_step],
                             accumulate)
            else:
                for c in range(c0, c1):
                    for r in range(r0, r1):
                        _put(dst + c * dst_ld + r * dst_step, src[r * src_ld + c * src_step],
                             accumulate)


cdef inline void _put(floating* at, floating value, bint accumulate) noexcept nogil:
    if accumulate:
        at[0] += value
    else:
        at[0] = value


cdef inline Py_ssize_t _phase_position(const TapPlan* s, Py_ssize_t h,
                                       Py_ssize_t w) noexcept nogil:
    """Where input pixel (h, w) lies in a channel of x~: its stride phase's plane, then its row
    and column there."""
    cdef const ConvGeometry* g = &s.g
    return (((h % g.sh) * g.sw + w % g.sw) * s.Hq + h // g.sh) * s.Wq + w // g.sw


cdef void _relayout(floating* planes, Py_ssize_t planes_ld, floating* channel,
                    const TapPlan* s, bint into_channel) noexcept nogil:
    """Between one input channel's plane (H, W) in every image (planes, the images planes_ld
    apart) and that channel of x~ (pixels in phase order, images innermost): into the
    channel if into_channel, else back. Piece by piece: a row's pixels of one column phase
    (a, a + sw, ...) are consecutive in x~; at stride 1 the whole plane is one piece."""
    cdef const ConvGeometry* g = &s.g
    cdef bint strided = g.sh > 1 or g.sw > 1
    cdef Py_ssize_t rows = g.H if strided else 1
    cdef Py_ssize_t phases = (g.sw if g.sw < g.W else g.W) if strided else 1
    cdef Py_ssize_t h, a, n, step
    cdef floating* piece
    for h in range(rows):
        for a in range(phases):
            if strided:
                n, step = (g.W - a + g.sw - 1) // g.sw, g.sw
            else:
                n, step = g.H * g.W, 1
            piece = channel + _phase_position(s, h, a) * g.N
            if into_channel:
                _transpose(piece, g.N, 1, planes + h * g.W + a, planes_ld, step, g.N, n, False)
            else:
                _transpose(planes + h * g.W + a, planes_ld, step, piece, g.N, 1, n, g.N, False)


cdef inline void _repack_weights(floating* wt, const floating* w, const TapPlan* s,
                                 Py_ssize_t o) noexcept nogil:
    """Output channel o of wt (C_out, taps, C_in) from w (C_out, C_in, kh, kw)."""
    cdef Py_ssize_t C = s.g.C
    _transpose(wt + o * s.taps * C, C, 1, w + o * C * s.taps, s.taps, 1, C, s.taps, False)


cdef inline void _pack_taps(uint16_t* panels, const float* w, const TapPlan* s, Py_ssize_t p,
                            bint transposed) noexcept nogil:
    """Panel p of every tap of w (C_out, C_in, kh, kw) as bf16 panels: w_t (C_out, C_in), or
    w_t^T, tap t's at panels + t * tap_panels."""
    cdef Py_ssize_t rows = s.g.C if transposed else s.g.Co
    cdef Py_ssize_t depth = s.g.Co if transposed else s.g.C
    cdef Py_ssize_t per_input = s.taps, per_output = s.g.C * s.taps
    bf16_panel_pack_taps(panels, s.tap_panels, w, rows, depth,
                         per_input if transposed else per_output,
                         per_output if transposed else per_input, <int> s.taps, p, p + 1)


cdef inline Py_ssize_t _block_start(Py_ssize_t k, Py_ssize_t parts, Py_ssize_t n) noexcept nogil:
    """First row of part k when n rows are split into parts blocks of whole panels (part k
    ends where part k + 1 starts). Callers assign the result, never pass a pointer to it: prange
    keeps only assigned variables private to a thread."""
    cdef Py_ssize_t size = (n + parts - 1) // parts
    size = (size + BLOCK_ROWS - 1) // BLOCK_ROWS * BLOCK_ROWS
    return k * size if k * size < n else n


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   const void* plan, floating* work) noexcept nogil:
    cdef const TapPlan* s = <const TapPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t P = g.Ho * g.Wo, HW = g.H * g.W
    cdef int threads = s.threads
    cdef Py_ssize_t k, c, o, o0, o1, r, q, p
    cdef Run* runs = <Run*> work
    cdef floating* xt = <floating*> (<char*> work + s.runs_bytes)
    cdef floating* yt = xt + g.C * s.in_ld
    cdef floating* wt = xt + s.at_wt
    cdef bint bf16 = floating is float and s.bf16
    cdef uint16_t* panels = <uint16_t*> wt
    _list_runs(runs, s)
    with parallel(num_threads=threads):
        for c in prange(g.C, schedule="static"):
            _relayout(<floating*> x + c * HW, g.C * HW, xt + c * s.in_ld, s, True)
        if bf16:
            for p in prange(bf16_panel_count(g.Co), schedule="static"):
                _pack_taps(panels, <const float*> w, s, p, False)
        else:
            for o in prange(g.Co, schedule="static"):
                _repack_weights(wt, w, s, o)
        for k in prange(threads, schedule="static"):
            o0 = _block_start(k, threads, g.Co)
            o1 = _block_start(k + 1, threads, g.Co)
            for o in range(o0, o1):
                for q in range(s.out_ld):
                    yt[o * s.out_ld + q] = b[o] if b != NULL else 0
            if o1 > o0 and bf16:
                for r in range(s.runs):
                    bf16_panel_gemm(s.bf16,
                                    <float*> (yt + o0 * s.out_ld + runs[r].out), s.out_ld,
                                    panels + runs[r].tap * s.tap_panels
                                    + bf16_panel_offset(o0, 0, g.C), o1 - o0, g.C,
                                    <const float*> (xt + runs[r].inp), s.in_ld, False,
                                    runs[r].length, NULL, s.panel_block, True)
            elif o1 > o0:
                for r in range(s.runs):
                    gemm(False, False, <int> (o1 - o0), <int> runs[r].length, <int> g.C,
                         <floating> 1, wt + o0 * s.taps * g.C + runs[r].tap * g.C,
                         <int> (s.taps * g.C),
                         xt + runs[r].inp, <int> s.in_ld, <floating> 1,
                         yt + o0 * s.out_ld + runs[r].out, <int> s.out_ld)
            for o in range(o0, o1):
                _transpose(y + o * P, g.Co * P, 1, yt + o * s.out_ld, g.N, 1, P, g.N, False)


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, const void* plan,
                    floating* work) noexcept nogil:
    cdef const TapPlan* s = <const TapPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t P = g.Ho * g.Wo, HW = g.H * g.W
    cdef int threads = s.threads
    cdef Py_ssize_t k, c, o, o0, o1, c0, c1, r, t, p
    cdef floating beta
    cdef floating* dwt_t
    cdef Run* runs = <Run*> work
    cdef floating* xt = <floating*> (<char*> work + s.runs_bytes)
    cdef floating* dyt = xt + g.C * s.in_ld
    cdef floating* wt = xt + s.at_wt
    cdef floating* dxt = xt + s.at_dxt
    cdef floating* dwt = xt + s.at_dwt
    cdef bint bf16 = floating is float and s.bf16
    cdef uint16_t* panels = <uint16_t*> wt
    _list_runs(runs, s)
    with parallel(num_threads=threads):
        for c in prange(g.C, schedule="static"):
            _relayout(<floating*> x + c * HW, g.C * HW, xt + c * s.in_ld, s, True)
        if bf16 and dx != NULL:
            for p in prange(bf16_panel_count(g.C), schedule="static"):
                _pack_taps(panels, <const float*> w, s, p, True)
        for o in prange(g.Co, schedule="static"):
            _transpose(dyt + o * s.out_ld, g.N, 1, dy + o * P, g.Co * P, 1, g.N, P, False)
            if db != NULL:
                db[o] += <floating> runs_sum(dyt + o * s.out_ld, 1, 0, s.out_ld)
            if dx != NULL and not bf16:
                _repack_weights(wt, w, s, o)
        for k in prange(threads, schedule="static"):
            # Weight gradient of this thread's output channels, tap by tap.
            o0 = _block_start(k, threads, g.Co)
            o1 = _block_start(k + 1, threads, g.Co)
            if o1 > o0:
                r = 0
                for t in range(s.taps):
                    dwt_t = dwt + o0 * s.taps * g.C + t * g.C
                    if r == s.runs or runs[r].tap != t:
                        for o in range(o1 - o0):
                            memset(dwt_t + o * s.taps * g.C, 0, g.C * sizeof(floating))
                    beta = 0
                    while r < s.runs and runs[r].tap == t:
                        if bf16:
                            bf16_gemm_nt(s.bf16, <float*> dwt_t, s.taps * g.C,
                                         <const float*> (dyt + o0 * s.out_ld + runs[r].out),
                                         s.out_ld, o1 - o0, <const float*> (xt + runs[r].inp),
                                         s.in_ld, g.C, runs[r].length,
                                         <uint16_t*> (xt + s.at_nt + k * s.nt_size),
                                         s.panel_block, beta != 0)
                        else:
                            gemm(False, True, <int> (o1 - o0), <int> g.C,
                                 <int> runs[r].length, <floating> 1,
                                 dyt + o0 * s.out_ld + runs[r].out, <int> s.out_ld,
                                 xt + runs[r].inp, <int> s.in_ld, beta, dwt_t,
                                 <int> (s.taps * g.C))
                        beta = 1
                        r = r + 1
            for o in range(o0, o1):
                _transpose(dw + o * g.C * s.taps, s.taps, 1, dwt + o * s.taps * g.C, g.C, 1,
                           s.taps, g.C, True)
            if dx == NULL:
                continue
            # Input gradient of this thread's input channels.
            c0 = _block_start(k, threads, g.C)
            c1 = _block_start(k + 1, threads, g.C)
            if c1 > c0:
                memset(dxt + c0 * s.in_ld, 0, (c1 - c0) * s.in_ld * sizeof(floating))
            if c1 > c0 and bf16:
                for r in range(s.runs):
                    bf16_panel_gemm(s.bf16,
                                    <float*> (dxt + c0 * s.in_ld + runs[r].inp), s.in_ld,
                                    panels + runs[r].tap * s.tap_panels
                                    + bf16_panel_offset(c0, 0, g.Co), c1 - c0, g.Co,
                                    <const float*> (dyt + runs[r].out), s.out_ld, False,
                                    runs[r].length, NULL, s.panel_block, True)
            elif c1 > c0:
                for r in range(s.runs):
                    gemm(True, False, <int> (c1 - c0), <int> runs[r].length, <int> g.Co,
                         <floating> 1, wt + runs[r].tap * g.C + c0, <int> (s.taps * g.C),
                         dyt + runs[r].out, <int> s.out_ld, <floating> 1,
                         dxt + c0 * s.in_ld + runs[r].inp, <int> s.in_ld)
            for c in range(c0, c1):
                _relayout(dx + c * HW, g.C * HW, dxt + c * s.in_ld, s, False)


cdef ConvAlgorithm _TAPGEMM = ConvAlgorithm(
    b"tapgemm", b"any kernel, stride and padding", sizeof(TapPlan), NULL, _plan,
    _forward[float], _forward[double], _backward[float], _backward[double])
algorithm = conv.Algorithm(algorithm_capsule(&_TAPGEMM))
forward, backward, supports = algorithm.forward, algorithm.backward, algorithm.supports
