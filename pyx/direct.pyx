"""2-D stride-1 convolution computed tap by tap, for layers with few channels: forward,
weight/bias gradient, input gradient.

On a layer like LeNet's (1 or 6 input channels, 6 or 16 output channels, 5x5) im2col/GEMM
spends its time unfolding 25 copies of a small image and packing GEMM operands a few rows
tall; the multiply-adds are the smaller part. Here nothing is unfolded. Each image is copied
once into a zero-padded plane of row width Wp = W + 2*pw, read flat: output position
q = oh*Wp + ow takes tap (i, j) from padded position q + i*Wp + j, so every tap is one
contiguous run of the plane (include/direct_taps.h). Per image:
    forward:      xp (C, Hp*Wp)  = x, zero-padded
                  out (C_out, L) = sum over taps of w[:, c, i, j] * xp[c, i*Wp + j :] + b
                  y = the first W_out columns of every row of out
    weight grad:  gq (C_out, L)  = dy at row width Wp, zero in the columns past W_out
                  dw[co, c, i, j] += sum over q of gq[co, q] * xp[c, q + i*Wp + j]
    input grad:   the same correlation with the kernel flipped and C_in, C_out swapped, over
                  gq with (kh-1) rows and (kw-1) zeros in front: dxp (C, Hp*Wp), whose
                  interior is dx.
The columns past W_out cost (Wp - W_out) / W_out more multiply-adds than the convolution
has; with few channels that is still far less than im2col's copies.

Parallelism: `prange` over images. Each thread sums its weight and bias gradients in vector
lanes of its own; after the images the lanes and threads are added in a fixed order, so a
run is deterministic for a given thread count.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.stdint cimport uintptr_t
from libc.string cimport memset
cimport numpy as cnp
cimport openmp

from _convargs cimport check_conv_backward, check_conv_forward
from _scratch cimport Scratch, scratch_give, scratch_take
from _validate cimport F32, FloatKind, check_pair, data

cnp.import_array()

cdef Scratch _scratch   # padded planes, flipped weights and weight-gradient lanes

cdef extern from "plane_rows.h" nogil:
    void rows_copy_f(float* dst, Py_ssize_t dst_ld, const float* src, Py_ssize_t src_ld,
                     Py_ssize_t rows, Py_ssize_t n)
    void rows_copy_d(double* dst, Py_ssize_t dst_ld, const double* src, Py_ssize_t src_ld,
                     Py_ssize_t rows, Py_ssize_t n)

cdef extern from "direct_taps.h" nogil:
    enum:
        DIRECT_LANES
        DIRECT_PREFERRED_MAX_PAIRS
    void direct_correlate_f(float* out, Py_ssize_t out_ld, const float* inp, Py_ssize_t plane,
                            Py_ssize_t Wp, const float* w, const float* bias, Py_ssize_t Co,
                            Py_ssize_t C, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t npos)
    void direct_correlate_d(double* out, Py_ssize_t out_ld, const double* inp,
                            Py_ssize_t plane, Py_ssize_t Wp, const double* w,
                            const double* bias, Py_ssize_t Co, Py_ssize_t C, Py_ssize_t kh,
                            Py_ssize_t kw, Py_ssize_t npos)
    void direct_weight_grad_f(float* lanes, const float* g, Py_ssize_t g_ld, const float* inp,
                              Py_ssize_t plane, Py_ssize_t Wp, Py_ssize_t Co, Py_ssize_t C,
                              Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t npos)
    void direct_weight_grad_d(double* lanes, const double* g, Py_ssize_t g_ld,
                              const double* inp, Py_ssize_t plane, Py_ssize_t Wp,
                              Py_ssize_t Co, Py_ssize_t C, Py_ssize_t kh, Py_ssize_t kw,
                              Py_ssize_t npos)
    void direct_bias_grad_f(float* lanes, const float* g, Py_ssize_t g_ld, Py_ssize_t Co,
                            Py_ssize_t npos)
    void direct_bias_grad_d(double* lanes, const double* g, Py_ssize_t g_ld, Py_ssize_t Co,
                            Py_ssize_t npos)


def direct_supports(w_shape, stride=1):
    """Whether the direct kernels compute conv2d at this stride: stride 1, any kernel and
    padding."""
    return check_pair("stride", stride, 1) == (1, 1)


# Where the direct kernels beat the others (`python -m perf kernels`, batch 64, forward +
# backward, 2 threads of a Zen 4, built for AVX-512): up to 1024 channel pairs
# (C_in * C_out) they run 1.7-2.7x im2col/GEMM (LeNet's layers, 3-channel first layers,
# 16 -> 32 5x5, 32 -> 32 3x3) and 1.1-3x Winograd on 3x3 layers with 16x16 outputs or more;
# past that BLAS's blocked GEMM and Winograd reuse loads better (64 -> 64 at 32x32: 0.94x
# Winograd; 128 -> 128: 0.5x). How many pairs depends on the vector width the build has
# (DIRECT_PREFERRED_MAX_PAIRS, include/direct_taps.h). On planes under 16x16 the columns
# computed past each row's end cost more and Winograd's lane kernels win on 3x3 layers
# (16 -> 16 at 8x8: 0.9x, 32 -> 32 at 8x8: 0.56x).
DEF PREFERRED_MIN_PIXELS_3X3 = 256
# Channel pairs up to which this build prefers the direct kernels.
PREFERRED_MAX_PAIRS = DIRECT_PREFERRED_MAX_PAIRS


def direct_preferred(x_shape, w_shape, stride=1, padding=0):
    """Whether a layer should run on the direct kernels rather than Winograd or im2col/GEMM."""
    if not direct_supports(w_shape, stride):
        return False
    xs, ws = tuple(x_shape), tuple(w_shape)
    ph, pw = check_pair("padding", padding, 0)
    pixels = (xs[2] + 2 * ph - ws[2] + 1) * (xs[3] + 2 * pw - ws[3] + 1)
    if ws[2] == 3 and ws[3] == 3 and pixels < PREFERRED_MIN_PIXELS_3X3:
        return False
    return ws[0] * ws[1] <= DIRECT_PREFERRED_MAX_PAIRS


cdef inline Py_ssize_t _round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return (n + m - 1) // m * m


# The workspace starts on a cache line, and every buffer in it on a vector boundary, so the
# kernels' vector loads of output-gradient rows and stores of outputs and lanes never
# straddle two lines (LeNet's conv2 weight gradient: 1.2x faster on Zen 4).
DEF ALIGN_BYTES = 64


cdef inline void* _aligned(void* p) noexcept nogil:
    return <void*> ((<uintptr_t> p + ALIGN_BYTES - 1) & ~(<uintptr_t> (ALIGN_BYTES - 1)))


cdef struct DirectShape:
    Py_ssize_t N, C, H, W, Co, kh, kw, ph, pw, Ho, Wo
    Py_ssize_t Wp       # row width of every padded plane: W + 2*pw
    Py_ssize_t plane    # one padded input plane: (H + 2*ph) * Wp
    Py_ssize_t L        # output positions at row width Wp: Ho * Wp
    Py_ssize_t Lq       # L rounded up to whole vectors: the positions forward computes and
                        # the gradients sum over
    Py_ssize_t Lx       # plane rounded up to whole vectors: the positions of the input
                        # gradient
    Py_ssize_t xp_size  # padded input, plus the zeros the last blocks read past its end
    Py_ssize_t lead     # zeros in front of the output gradient in gz: (kh-1)*Wp + kw-1
    Py_ssize_t gz_plane # one channel of gz
    Py_ssize_t gz_front # gz's offset in its buffer
    Py_ssize_t gz_size  # gz's buffer, with the zeros the last block reads past its end


cdef DirectShape _plan(object xa, object wa, object padding, int* threads) except *:
    cdef DirectShape s
    s.N, s.C, s.H, s.W = (<object> xa).shape
    s.Co, _, s.kh, s.kw = (<object> wa).shape
    s.ph, s.pw = check_pair("padding", padding, 0)
    s.Ho = s.H + 2 * s.ph - s.kh + 1
    s.Wo = s.W + 2 * s.pw - s.kw + 1
    s.Wp = s.W + 2 * s.pw
    s.plane = (s.H + 2 * s.ph) * s.Wp
    s.L = s.Ho * s.Wp
    s.Lq = _round_up(s.L, DIRECT_LANES)
    s.Lx = _round_up(s.plane, DIRECT_LANES)
    # The last channel's taps read up to (Lq - L) + kw - 1 past its plane.
    s.xp_size = _round_up(s.C * s.plane + (s.Lq - s.L) + s.kw, DIRECT_LANES)
    s.lead = (s.kh - 1) * s.Wp + s.kw - 1
    # A channel's kept input-gradient positions (q < plane) and its weight-gradient sums
    # (q < Lq) must read only its own zeros and values, never the next channel's; the last
    # channel's discarded positions (plane <= q < Lx) read up to a vector past it.
    s.gz_plane = _round_up(s.lead + (s.plane if s.plane > s.Lq else s.Lq), DIRECT_LANES)
    # gz starts gz_front into its buffer so that the output gradient's rows (gz + lead +
    # co * gz_plane) start on a vector boundary: the weight gradient loads them as vectors.
    s.gz_front = (DIRECT_LANES - s.lead % DIRECT_LANES) % DIRECT_LANES
    s.gz_size = _round_up(s.gz_front + s.Co * s.gz_plane + DIRECT_LANES, DIRECT_LANES)
    threads[0] = openmp.omp_get_max_threads()
    if threads[0] > s.N:
        threads[0] = <int> s.N
    return s


cdef inline void _rows_copy(floating* dst, Py_ssize_t dst_ld, const floating* src,
                            Py_ssize_t src_ld, Py_ssize_t rows, Py_ssize_t n) noexcept nogil:
    if floating is float:
        rows_copy_f(dst, dst_ld, src, src_ld, rows, n)
    else:
        rows_copy_d(dst, dst_ld, src, src_ld, rows, n)


# The padded buffers (xp, gz) are zeroed once per call and thread: every image then
# overwrites the same interior positions, so the padding, the columns past each row and the
# tails stay zero.

cdef inline void _pad_input(floating* xp, const floating* x, const DirectShape* s) noexcept nogil:
    """The interior of xp (C, plane), zero around it = one image x (C, H, W)."""
    cdef Py_ssize_t c
    for c in range(s.C):
        _rows_copy(xp + c * s.plane + s.ph * s.Wp + s.pw, s.Wp, x + c * s.H * s.W, s.W, s.H, s.W)


cdef inline void _correlate(floating* out, Py_ssize_t out_ld, const floating* inp,
                            Py_ssize_t plane, Py_ssize_t Wp, const floating* w,
                            const floating* bias, Py_ssize_t Co, Py_ssize_t C, Py_ssize_t kh,
                            Py_ssize_t kw, Py_ssize_t npos) noexcept nogil:
    if floating is float:
        direct_correlate_f(out, out_ld, inp, plane, Wp, w, bias, Co, C, kh, kw, npos)
    else:
        direct_correlate_d(out, out_ld, inp, plane, Wp, w, bias, Co, C, kh, kw, npos)


cdef inline Py_ssize_t _forward_workspace(const DirectShape* s) noexcept nogil:
    return s.xp_size + s.Co * s.Lq


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   DirectShape s, floating* work, int threads) noexcept nogil:
    cdef Py_ssize_t per_thread = _forward_workspace(&s)
    cdef Py_ssize_t n, co
    cdef floating* xp = NULL
    cdef floating* out = NULL
    with parallel(num_threads=threads):
        xp = work + threadid() * per_thread
        out = xp + s.xp_size
        memset(xp, 0, s.xp_size * sizeof(floating))
        for n in prange(s.N, schedule="static"):
            _pad_input(xp, x + n * s.C * s.H * s.W, &s)
            _correlate(out, s.Lq, xp, s.plane, s.Wp, w, b, s.Co, s.C, s.kh, s.kw, s.Lq)
            for co in range(s.Co):
                _rows_copy(y + (n * s.Co + co) * s.Ho * s.Wo, s.Wo, out + co * s.Lq, s.Wp,
                           s.Ho, s.Wo)


cdef inline Py_ssize_t _backward_workspace(const DirectShape* s) noexcept nogil:
    # padded input, gz, the padded input gradient, the weight- and bias-gradient lanes
    return s.xp_size + s.gz_size + s.C * s.Lx + (s.Co * s.C * s.kh * s.kw + s.Co) * DIRECT_LANES


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, DirectShape s, floating* flipped,
                    floating* work, int threads) noexcept nogil:
    cdef Py_ssize_t per_thread = _backward_workspace(&s)
    cdef Py_ssize_t taps = s.kh * s.kw
    cdef Py_ssize_t wsize = s.Co * s.C * taps
    cdef Py_ssize_t lanes_at = s.xp_size + s.gz_size + s.C * s.Lx
    cdef Py_ssize_t n, co, c, t, k, l
    cdef floating* xp = NULL
    cdef floating* gz = NULL
    cdef floating* dxp = NULL
    cdef floating* lanes = NULL
    cdef double acc
    # The input gradient correlates with the kernel flipped and the channels swapped:
    # flipped[c, co, kh-1-i, kw-1-j] = w[co, c, i, j].
    if dx != NULL:
        for co in range(s.Co):
            for c in range(s.C):
                for t in range(taps):
                    flipped[(c * s.Co + co) * taps + taps - 1 - t] = w[(co * s.C + c) * taps + t]
    with parallel(num_threads=threads):
        xp = work + threadid() * per_thread
        gz = xp + s.xp_size + s.gz_front
        dxp = xp + s.xp_size + s.gz_size
        lanes = xp + lanes_at
        memset(lanes, 0, (wsize + s.Co) * DIRECT_LANES * sizeof(floating))
        memset(xp, 0, (s.xp_size + s.gz_size) * sizeof(floating))
        for n in prange(s.N, schedule="static"):
            _pad_input(xp, x + n * s.C * s.H * s.W, &s)
            for co in range(s.Co):
                _rows_copy(gz + co * s.gz_plane + s.lead, s.Wp,
                           dy + (n * s.Co + co) * s.Ho * s.Wo, s.Wo, s.Ho, s.Wo)
            if floating is float:
                direct_weight_grad_f(lanes, gz + s.lead, s.gz_plane, xp, s.plane, s.Wp, s.Co,
                                     s.C, s.kh, s.kw, s.Lq)
                if db != NULL:
                    direct_bias_grad_f(lanes + wsize * DIRECT_LANES, gz + s.lead, s.gz_plane,
                                       s.Co, s.Lq)
            else:
                direct_weight_grad_d(lanes, gz + s.lead, s.gz_plane, xp, s.plane, s.Wp, s.Co,
                                     s.C, s.kh, s.kw, s.Lq)
                if db != NULL:
                    direct_bias_grad_d(lanes + wsize * DIRECT_LANES, gz + s.lead, s.gz_plane,
                                       s.Co, s.Lq)
            if dx != NULL:
                _correlate(dxp, s.Lx, gz, s.gz_plane, s.Wp, flipped, NULL, s.C, s.Co, s.kh,
                           s.kw, s.Lx)
                for c in range(s.C):
                    _rows_copy(dx + (n * s.C + c) * s.H * s.W, s.W,
                               dxp + c * s.Lx + s.ph * s.Wp + s.pw, s.Wp, s.H, s.W)
    # dw, then db, += the lanes of every thread, in thread order, parallel over the weights.
    for k in prange(wsize + (s.Co if db != NULL else 0), schedule="static",
                    num_threads=threads, nogil=True):
        acc = 0
        for t in range(threads):
            for l in range(DIRECT_LANES):
                acc = acc + work[t * per_thread + lanes_at + k * DIRECT_LANES + l]
        if k < wsize:
            dw[k] += <floating> acc
        else:
            db[k - wsize] += <floating> acc


def direct_forward(y, x, w, b=None, padding=0):
    """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, kh, kw)) + b,
    stride 1; the same contract as conv.conv2d_forward. y is overwritten; b may be None."""
    cdef FloatKind kind = F32
    ya, xa, wa, ba = check_conv_forward(y, x, w, b, 1, padding, &kind)
    cdef int threads
    cdef DirectShape s = _plan(xa, wa, padding, &threads)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef bint private
    cdef void* work = scratch_take(
        &_scratch, threads * _forward_workspace(&s) * itemsize + ALIGN_BYTES, &private)
    cdef void* aligned = _aligned(work)
    cdef void* yp = data(ya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef void* bp = data(ba)
    try:
        with nogil:
            if kind == F32:
                _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp, s,
                         <float*> aligned, threads)
            else:
                _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp, s,
                         <double*> aligned, threads)
    finally:
        scratch_give(&_scratch, work, private)


def direct_backward(dx, dw, db, dy, x, w, padding=0):
    """Gradients of direct_forward given dy; the same contract as conv.conv2d_backward:
    dx is overwritten (None skips it), dw and db are accumulated into (db may be None)."""
    cdef FloatKind kind = F32
    dxa, dwa, dba, dya, xa, wa = check_conv_backward(dx, dw, db, dy, x, w, 1, padding, &kind)
    cdef int threads
    cdef DirectShape s = _plan(xa, wa, padding, &threads)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t flipped_size = _round_up(s.Co * s.C * s.kh * s.kw, DIRECT_LANES)
    cdef bint private
    cdef void* work = scratch_take(
        &_scratch, (flipped_size + threads * _backward_workspace(&s)) * itemsize + ALIGN_BYTES,
        &private)
    cdef void* aligned = _aligned(work)
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
                          <float*> wp, s, <float*> aligned, <float*> aligned + flipped_size,
                          threads)
            else:
                _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                          <double*> xp, <double*> wp, s, <double*> aligned,
                          <double*> aligned + flipped_size, threads)
    finally:
        scratch_give(&_scratch, work, private)
