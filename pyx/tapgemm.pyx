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
"""
from cython cimport floating
from cython.parallel cimport prange, parallel
from libc.string cimport memset
cimport numpy as cnp
cimport openmp

from _blas cimport gemm
from _convargs cimport check_conv_backward, check_conv_forward
from _scratch cimport Scratch, scratch_give, scratch_take
from _tap_range cimport tap_end_valid, tap_first_valid
from _validate cimport F32, FloatKind, check_blas_dim, check_pair, data

cnp.import_array()

cdef Scratch _scratch   # runs, the batch in tap layout, repacked weights and their gradient

# Where the per-tap GEMMs beat the others (`python -m perf kernels`, batch 64, forward +
# backward, 2 threads of a Zen 4): on 3x3 layers with a 2x2 output, at any channel count
# (stride 1: 1.1-1.3x the GEMM ceiling against im2col's 5-55% and Winograd's 25-40%); with a
# 4x4 output from 192 channels on (AlexNet's and VGG's: 1.15-1.2x Winograd; ResNet's 256 -> 512
# at stride 2: 1.05-1.2x im2col), not below (128 -> 128: 0.97x Winograd, 64 -> 64: 0.75x;
# 128 -> 256 at stride 2: 1.0x im2col). On larger planes the 9 taps each pack the whole input
# for BLAS, and im2col or Winograd win (stride 2, 16x16 outputs: 0.67x im2col).
DEF ANY_CHANNELS_MAX_PIXELS = 4
DEF PREFERRED_MAX_PIXELS = 16
DEF PREFERRED_MIN_CHANNELS = 192
# Rows of a thread's block are a multiple of this, so BLAS's micro-kernels see whole panels.
DEF BLOCK_ROWS = 16
# Side of the square tiles the layout changes copy.
DEF TRANSPOSE_TILE = 16


def tapgemm_preferred(x_shape, w_shape, stride=1, padding=0):
    """Whether a layer should run on the per-tap GEMMs rather than Winograd or im2col/GEMM."""
    xs, ws = tuple(x_shape), tuple(w_shape)
    if ws[2] * ws[3] == 1:
        return False   # one tap: nothing to skip (and at stride 2, three phases unused)
    sh, sw = check_pair("stride", stride, 1)
    ph, pw = check_pair("padding", padding, 0)
    pixels = ((xs[2] + 2 * ph - ws[2]) // sh + 1) * ((xs[3] + 2 * pw - ws[3]) // sw + 1)
    return pixels <= ANY_CHANNELS_MAX_PIXELS or (
        pixels <= PREFERRED_MAX_PIXELS and min(xs[1], ws[0]) >= PREFERRED_MIN_CHANNELS)


cdef struct TapShape:
    Py_ssize_t N, C, H, W, Co, kh, kw, sh, sw, ph, pw, Ho, Wo
    Py_ssize_t Hq, Wq   # a stride phase's plane: ceil(H / sh) x ceil(W / sw)
    Py_ssize_t taps     # kh*kw
    Py_ssize_t in_ld    # sh*sw*Hq*Wq*N: one input channel of x~
    Py_ssize_t out_ld   # Ho*Wo*N: one output channel of y~
    Py_ssize_t runs     # how many runs the taps have in all


cdef struct Run:
    Py_ssize_t tap      # i*kw + j
    Py_ssize_t out      # first column of the run in y~
    Py_ssize_t inp      # first column of the input pixels it pairs with in x~
    Py_ssize_t length   # columns


cdef inline Py_ssize_t _floor_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    # (the module divides the C way, truncating; a tap's offset from the padding can be < 0)
    return a // b if a >= 0 else -((-a + b - 1) // b)


cdef Py_ssize_t _list_runs(Run* runs, const TapShape* s) noexcept nogil:
    """Write the runs of every tap, grouped by tap in tap order, to runs (unless NULL);
    return how many there are.

    Tap (i, j) reads input row oh*sh + i - ph = (oh + di)*sh + ai with 0 <= ai < sh: row
    oh + di of stride phase ai, and likewise for columns; so an output row's valid pixels
    read one contiguous row segment of one phase plane."""
    cdef Py_ssize_t n = 0, i, j, top, bottom, lo, hi, oh, di, dj, plane, inp
    cdef Py_ssize_t N = s.N
    for i in range(s.kh):
        top = tap_first_valid(s.ph, i, s.sh, s.Ho)
        bottom = tap_end_valid(s.ph, i, s.sh, s.H, s.Ho)
        di = _floor_div(i - s.ph, s.sh)
        for j in range(s.kw):
            lo = tap_first_valid(s.pw, j, s.sw, s.Wo)
            hi = tap_end_valid(s.pw, j, s.sw, s.W, s.Wo)
            if bottom <= top or hi <= lo:
                continue   # the tap reads only padding
            dj = _floor_div(j - s.pw, s.sw)
            plane = ((i - s.ph - di * s.sh) * s.sw + j - s.pw - dj * s.sw) * s.Hq * s.Wq
            if lo == 0 and hi == s.Wo and s.Wo == s.Wq:
                # Whole rows on both sides, of the same length: the rows are one run.
                if runs != NULL:
                    runs[n] = Run(i * s.kw + j, top * s.Wo * N,
                                  (plane + (top + di) * s.Wq) * N, (bottom - top) * s.Wo * N)
                n += 1
                continue
            for oh in range(top, bottom):
                if runs != NULL:
                    inp = (plane + (oh + di) * s.Wq + lo + dj) * N
                    runs[n] = Run(i * s.kw + j, (oh * s.Wo + lo) * N, inp, (hi - lo) * N)
                n += 1
    return n


cdef TapShape _shape(object xa, object wa, object stride, object padding) except *:
    cdef TapShape s
    s.N, s.C, s.H, s.W = (<object> xa).shape
    s.Co, _, s.kh, s.kw = (<object> wa).shape
    s.sh, s.sw = check_pair("stride", stride, 1)
    s.ph, s.pw = check_pair("padding", padding, 0)
    s.Ho = (s.H + 2 * s.ph - s.kh) // s.sh + 1
    s.Wo = (s.W + 2 * s.pw - s.kw) // s.sw + 1
    s.taps = s.kh * s.kw
    s.Hq = (s.H + s.sh - 1) // s.sh
    s.Wq = (s.W + s.sw - 1) // s.sw
    s.in_ld = s.sh * s.sw * s.Hq * s.Wq * s.N
    s.out_ld = s.Ho * s.Wo * s.N
    check_blas_dim("tapgemm: C_in", s.C)
    check_blas_dim("tapgemm: C_out", s.Co)
    check_blas_dim("tapgemm: N*H*W (in stride phases)", s.in_ld)
    check_blas_dim("tapgemm: N*H_out*W_out", s.out_ld)
    s.runs = _list_runs(NULL, &s)
    return s


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


cdef inline Py_ssize_t _phase_position(const TapShape* s, Py_ssize_t h,
                                       Py_ssize_t w) noexcept nogil:
    """Where input pixel (h, w) lies in a channel of x~: its stride phase's plane, then its row
    and column there."""
    return (((h % s.sh) * s.sw + w % s.sw) * s.Hq + h // s.sh) * s.Wq + w // s.sw


cdef void _relayout(floating* planes, Py_ssize_t planes_ld, floating* channel,
                    const TapShape* s, bint into_channel) noexcept nogil:
    """Between one input channel's plane (H, W) in every image (planes, the images planes_ld
    apart) and that channel of x~ (pixels in phase order, images innermost): into the
    channel if into_channel, else back. Piece by piece: a row's pixels of one column phase
    (a, a + sw, ...) are consecutive in x~; at stride 1 the whole plane is one piece."""
    cdef bint strided = s.sh > 1 or s.sw > 1
    cdef Py_ssize_t rows = s.H if strided else 1
    cdef Py_ssize_t phases = (s.sw if s.sw < s.W else s.W) if strided else 1
    cdef Py_ssize_t h, a, n, step
    cdef floating* piece
    for h in range(rows):
        for a in range(phases):
            if strided:
                n, step = (s.W - a + s.sw - 1) // s.sw, s.sw
            else:
                n, step = s.H * s.W, 1
            piece = channel + _phase_position(s, h, a) * s.N
            if into_channel:
                _transpose(piece, s.N, 1, planes + h * s.W + a, planes_ld, step, s.N, n, False)
            else:
                _transpose(planes + h * s.W + a, planes_ld, step, piece, s.N, 1, n, s.N, False)


cdef inline void _repack_weights(floating* wt, const floating* w, const TapShape* s,
                                 Py_ssize_t o) noexcept nogil:
    """Output channel o of wt (C_out, taps, C_in) from w (C_out, C_in, kh, kw)."""
    _transpose(wt + o * s.taps * s.C, s.C, 1, w + o * s.C * s.taps, s.taps, 1, s.C, s.taps,
               False)


cdef inline Py_ssize_t _block_start(Py_ssize_t k, Py_ssize_t parts, Py_ssize_t n) noexcept nogil:
    """First row of part k when n rows are split into parts blocks of whole panels (part k
    ends where part k + 1 starts). Callers assign the result, never pass a pointer to it: prange
    keeps only assigned variables private to a thread."""
    cdef Py_ssize_t size = (n + parts - 1) // parts
    size = (size + BLOCK_ROWS - 1) // BLOCK_ROWS * BLOCK_ROWS
    return k * size if k * size < n else n


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   const TapShape* s, const Run* runs, floating* xt, floating* yt,
                   floating* wt, int threads) noexcept nogil:
    cdef Py_ssize_t P = s.Ho * s.Wo, HW = s.H * s.W
    cdef Py_ssize_t k, c, o, o0, o1, r, q
    with parallel(num_threads=threads):
        for c in prange(s.C, schedule="static"):
            _relayout(<floating*> x + c * HW, s.C * HW, xt + c * s.in_ld, s, True)
        for o in prange(s.Co, schedule="static"):
            _repack_weights(wt, w, s, o)
        for k in prange(threads, schedule="static"):
            o0 = _block_start(k, threads, s.Co)
            o1 = _block_start(k + 1, threads, s.Co)
            for o in range(o0, o1):
                for q in range(s.out_ld):
                    yt[o * s.out_ld + q] = b[o] if b != NULL else 0
            if o1 > o0:
                for r in range(s.runs):
                    gemm(False, False, <int> (o1 - o0), <int> runs[r].length, <int> s.C,
                         <floating> 1, wt + o0 * s.taps * s.C + runs[r].tap * s.C,
                         <int> (s.taps * s.C),
                         xt + runs[r].inp, <int> s.in_ld, <floating> 1,
                         yt + o0 * s.out_ld + runs[r].out, <int> s.out_ld)
            for o in range(o0, o1):
                _transpose(y + o * P, s.Co * P, 1, yt + o * s.out_ld, s.N, 1, P, s.N, False)


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, const TapShape* s, const Run* runs,
                    floating* xt, floating* dyt, floating* wt, floating* dxt, floating* dwt,
                    int threads) noexcept nogil:
    cdef Py_ssize_t P = s.Ho * s.Wo, HW = s.H * s.W
    cdef Py_ssize_t k, c, o, o0, o1, c0, c1, r, t, q
    cdef floating beta, acc
    cdef floating* dwt_t
    with parallel(num_threads=threads):
        for c in prange(s.C, schedule="static"):
            _relayout(<floating*> x + c * HW, s.C * HW, xt + c * s.in_ld, s, True)
        for o in prange(s.Co, schedule="static"):
            _transpose(dyt + o * s.out_ld, s.N, 1, dy + o * P, s.Co * P, 1, s.N, P, False)
            if db != NULL:
                acc = 0
                for q in range(s.out_ld):
                    acc = acc + dyt[o * s.out_ld + q]
                db[o] += acc
            if dx != NULL:
                _repack_weights(wt, w, s, o)
        for k in prange(threads, schedule="static"):
            # Weight gradient of this thread's output channels, tap by tap.
            o0 = _block_start(k, threads, s.Co)
            o1 = _block_start(k + 1, threads, s.Co)
            if o1 > o0:
                r = 0
                for t in range(s.taps):
                    dwt_t = dwt + o0 * s.taps * s.C + t * s.C
                    if r == s.runs or runs[r].tap != t:
                        for o in range(o1 - o0):
                            memset(dwt_t + o * s.taps * s.C, 0, s.C * sizeof(floating))
                    beta = 0
                    while r < s.runs and runs[r].tap == t:
                        gemm(False, True, <int> (o1 - o0), <int> s.C, <int> runs[r].length,
                             <floating> 1, dyt + o0 * s.out_ld + runs[r].out, <int> s.out_ld,
                             xt + runs[r].inp, <int> s.in_ld, beta, dwt_t, <int> (s.taps * s.C))
                        beta = 1
                        r = r + 1
            for o in range(o0, o1):
                _transpose(dw + o * s.C * s.taps, s.taps, 1, dwt + o * s.taps * s.C, s.C, 1,
                           s.taps, s.C, True)
            if dx == NULL:
                continue
            # Input gradient of this thread's input channels.
            c0 = _block_start(k, threads, s.C)
            c1 = _block_start(k + 1, threads, s.C)
            if c1 > c0:
                memset(dxt + c0 * s.in_ld, 0, (c1 - c0) * s.in_ld * sizeof(floating))
                for r in range(s.runs):
                    gemm(True, False, <int> (c1 - c0), <int> runs[r].length, <int> s.Co,
                         <floating> 1, wt + runs[r].tap * s.C + c0, <int> (s.taps * s.C),
                         dyt + runs[r].out, <int> s.out_ld, <floating> 1,
                         dxt + c0 * s.in_ld + runs[r].inp, <int> s.in_ld)
            for c in range(c0, c1):
                _relayout(dx + c * HW, s.C * HW, dxt + c * s.in_ld, s, False)


cdef inline size_t _runs_bytes(const TapShape* s) noexcept nogil:
    # The runs go first in the workspace; the floats after them start on a cache line.
    return (s.runs * sizeof(Run) + 63) // 64 * 64


def tapgemm_forward(y, x, w, b=None, stride=1, padding=0):
    """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, kh, kw)) + b (C_out,).

    y is overwritten. b may be None. stride, padding: int or (h, w)."""
    cdef FloatKind kind = F32
    ya, xa, wa, ba = check_conv_forward(y, x, w, b, stride, padding, &kind)
    cdef TapShape s = _shape(xa, wa, stride, padding)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t xt_size = s.C * s.in_ld, yt_size = s.Co * s.out_ld
    cdef Py_ssize_t wt_size = s.taps * s.Co * s.C
    cdef size_t head = _runs_bytes(&s)
    cdef bint private
    cdef char* work = <char*> scratch_take(
        &_scratch, head + (xt_size + yt_size + wt_size) * itemsize, &private)
    cdef Run* runs = <Run*> work
    cdef char* floats = work + head
    cdef int threads = openmp.omp_get_max_threads()
    cdef void* yp = data(ya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef void* bp = data(ba)
    try:
        with nogil:
            _list_runs(runs, &s)
            if kind == F32:
                _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp, &s, runs,
                         <float*> floats, <float*> floats + xt_size,
                         <float*> floats + xt_size + yt_size, threads)
            else:
                _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp, &s, runs,
                         <double*> floats, <double*> floats + xt_size,
                         <double*> floats + xt_size + yt_size, threads)
    finally:
        scratch_give(&_scratch, work, private)


def tapgemm_backward(dx, dw, db, dy, x, w, stride=1, padding=0):
    """Gradients of tapgemm_forward given dy (N, C_out, H_out, W_out).

    dx (N, C_in, H, W) is overwritten (None skips the input gradient, as for a first layer);
    dw (C_out, C_in, kh, kw) and db (C_out,) are accumulated into (+=); db may be None."""
    cdef FloatKind kind = F32
    dxa, dwa, dba, dya, xa, wa = check_conv_backward(dx, dw, db, dy, x, w, stride, padding,
                                                     &kind)
    cdef TapShape s = _shape(xa, wa, stride, padding)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t xt_size = s.C * s.in_ld, dyt_size = s.Co * s.out_ld
    cdef Py_ssize_t wt_size = s.taps * s.Co * s.C
    cdef Py_ssize_t dxt_size = xt_size if dxa is not None else 0
    cdef Py_ssize_t used_wt = wt_size if dxa is not None else 0
    cdef size_t head = _runs_bytes(&s)
    cdef bint private
    cdef char* work = <char*> scratch_take(
        &_scratch, head + (xt_size + dyt_size + used_wt + dxt_size + wt_size) * itemsize,
        &private)
    cdef Run* runs = <Run*> work
    cdef char* floats = work + head
    # x~, dy~, then (with an input gradient) w_t and dx~, then the weight gradient's taps
    cdef Py_ssize_t at_wt = xt_size + dyt_size
    cdef Py_ssize_t at_dxt = at_wt + used_wt
    cdef Py_ssize_t at_dwt = at_dxt + dxt_size
    cdef int threads = openmp.omp_get_max_threads()
    cdef void* dxp = data(dxa)
    cdef void* dwp = data(dwa)
    cdef void* dbp = data(dba)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    try:
        with nogil:
            _list_runs(runs, &s)
            if kind == F32:
                _backward(<float*> dxp, <float*> dwp, <float*> dbp, <float*> dyp, <float*> xp,
                          <float*> wp, &s, runs, <float*> floats, <float*> floats + xt_size,
                          <float*> floats + at_wt, <float*> floats + at_dxt,
                          <float*> floats + at_dwt, threads)
            else:
                _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                          <double*> xp, <double*> wp, &s, runs, <double*> floats,
                          <double*> floats + xt_size, <double*> floats + at_wt,
                          <double*> floats + at_dxt, <double*> floats + at_dwt, threads)
    finally:
        scratch_give(&_scratch, work, private)
