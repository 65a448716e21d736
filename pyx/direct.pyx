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

Entry points: `forward`, `backward`, `supports` (conv.Algorithm); stride 1, any kernel and
padding.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.string cimport memset
cimport numpy as cnp

from _conv_call cimport ConvAlgorithm, ConvCall, ConvGeometry, algorithm_capsule
from _parallel cimport threads_for
from _validate cimport F32

from dynar.kernels import conv

cnp.import_array()

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


# Channel pairs (C_in * C_out) up to which nn.Conv2d prefers these kernels in this build: it
# depends on the vector width the build targets (include/direct_taps.h).
PREFERRED_MAX_PAIRS = DIRECT_PREFERRED_MAX_PAIRS


cdef inline Py_ssize_t _round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return (n + m - 1) // m * m


# Every buffer in the workspace starts on a vector boundary (the workspace on a cache line),
# so the kernels' vector loads of output-gradient rows and stores of outputs and lanes never
# straddle two lines (docs/notes/2026-12-02-kernels.md, "Direct kernels").
cdef struct DirectPlan:
    ConvGeometry g
    int threads
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
    Py_ssize_t flipped_size  # backward: the flipped weights, ahead of the threads' buffers
    Py_ssize_t per_thread    # forward: xp, out; backward: xp, gz, the padded input
                             # gradient, the weight- and bias-gradient lanes


cdef Py_ssize_t _plan(const ConvCall* c, void* plan) except -1:
    cdef DirectPlan* s = <DirectPlan*> plan
    cdef const ConvGeometry* g = &c.g
    s.g = c.g
    s.threads = threads_for(g.N)
    s.Wp = g.W + 2 * g.pw
    s.plane = (g.H + 2 * g.ph) * s.Wp
    s.L = g.Ho * s.Wp
    s.Lq = _round_up(s.L, DIRECT_LANES)
    s.Lx = _round_up(s.plane, DIRECT_LANES)
    # The last channel's taps read up to (Lq - L) + kw - 1 past its plane.
    s.xp_size = _round_up(g.C * s.plane + (s.Lq - s.L) + g.kw, DIRECT_LANES)
    s.lead = (g.kh - 1) * s.Wp + g.kw - 1
    # A channel's kept input-gradient positions (q < plane) and its weight-gradient sums
    # (q < Lq) must read only its own zeros and values, never the next channel's; the last
    # channel's discarded positions (plane <= q < Lx) read up to a vector past it.
    s.gz_plane = _round_up(s.lead + (s.plane if s.plane > s.Lq else s.Lq), DIRECT_LANES)
    # gz starts gz_front into its buffer so that the output gradient's rows (gz + lead +
    # co * gz_plane) start on a vector boundary: the weight gradient loads them as vectors.
    s.gz_front = (DIRECT_LANES - s.lead % DIRECT_LANES) % DIRECT_LANES
    s.gz_size = _round_up(s.gz_front + g.Co * s.gz_plane + DIRECT_LANES, DIRECT_LANES)
    s.flipped_size = 0
    s.per_thread = s.xp_size + g.Co * s.Lq
    if c.backward:
        s.flipped_size = _round_up(g.Co * g.C * g.kh * g.kw, DIRECT_LANES)
        s.per_thread = (s.xp_size + s.gz_size + g.C * s.Lx
                        + (g.Co * g.C * g.kh * g.kw + g.Co) * DIRECT_LANES)
    return (s.flipped_size + s.threads * s.per_thread) * (4 if c.kind == F32 else 8)


cdef inline void _rows_copy(floating* dst, Py_ssize_t dst_ld, const floating* src,
                            Py_ssize_t src_ld, Py_ssize_t rows, Py_ssize_t n) noexcept nogil:
    if floating is float:
        rows_copy_f(dst, dst_ld, src, src_ld, rows, n)
    else:
        rows_copy_d(dst, dst_ld, src, src_ld, rows, n)


# The padded buffers (xp, gz) are zeroed once per call and thread: every image then
# overwrites the same interior positions, so the padding, the columns past each row and the
# tails stay zero.

cdef inline void _pad_input(floating* xp, const floating* x, const DirectPlan* s) noexcept nogil:
    """The interior of xp (C, plane), zero around it = one image x (C, H, W)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t c
    for c in range(g.C):
        _rows_copy(xp + c * s.plane + g.ph * s.Wp + g.pw, s.Wp, x + c * g.H * g.W, g.W, g.H, g.W)


cdef inline void _correlate(floating* out, Py_ssize_t out_ld, const floating* inp,
                            Py_ssize_t plane, Py_ssize_t Wp, const floating* w,
                            const floating* bias, Py_ssize_t Co, Py_ssize_t C, Py_ssize_t kh,
                            Py_ssize_t kw, Py_ssize_t npos) noexcept nogil:
    if floating is float:
        direct_correlate_f(out, out_ld, inp, plane, Wp, w, bias, Co, C, kh, kw, npos)
    else:
        direct_correlate_d(out, out_ld, inp, plane, Wp, w, bias, Co, C, kh, kw, npos)


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   const void* plan, floating* work) noexcept nogil:
    cdef const DirectPlan* s = <const DirectPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t n, co
    cdef floating* xp = NULL
    cdef floating* out = NULL
    with parallel(num_threads=s.threads):
        xp = work + threadid() * s.per_thread
        out = xp + s.xp_size
        memset(xp, 0, s.xp_size * sizeof(floating))
        for n in prange(g.N, schedule="static"):
            _pad_input(xp, x + n * g.C * g.H * g.W, s)
            _correlate(out, s.Lq, xp, s.plane, s.Wp, w, b, g.Co, g.C, g.kh, g.kw, s.Lq)
            for co in range(g.Co):
                _rows_copy(y + (n * g.Co + co) * g.Ho * g.Wo, g.Wo, out + co * s.Lq, s.Wp,
                           g.Ho, g.Wo)


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, const void* plan,
                    floating* work) noexcept nogil:
    cdef const DirectPlan* s = <const DirectPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t taps = g.kh * g.kw
    cdef Py_ssize_t wsize = g.Co * g.C * taps
    cdef floating* flipped = work
    cdef floating* buffers = work + s.flipped_size
    cdef Py_ssize_t lanes_at = s.xp_size + s.gz_size + g.C * s.Lx
    cdef Py_ssize_t n, co, c, t, k, l
    cdef floating* xp = NULL
    cdef floating* gz = NULL
    cdef floating* dxp = NULL
    cdef floating* lanes = NULL
    cdef double acc
    # The input gradient correlates with the kernel flipped and the channels swapped:
    # flipped[c, co, kh-1-i, kw-1-j] = w[co, c, i, j].
    if dx != NULL:
        for co in range(g.Co):
            for c in range(g.C):
                for t in range(taps):
                    flipped[(c * g.Co + co) * taps + taps - 1 - t] = w[(co * g.C + c) * taps + t]
    with parallel(num_threads=s.threads):
        xp = buffers + threadid() * s.per_thread
        gz = xp + s.xp_size + s.gz_front
        dxp = xp + s.xp_size + s.gz_size
        lanes = xp + lanes_at
        memset(lanes, 0, (wsize + g.Co) * DIRECT_LANES * sizeof(floating))
        memset(xp, 0, (s.xp_size + s.gz_size) * sizeof(floating))
        for n in prange(g.N, schedule="static"):
            _pad_input(xp, x + n * g.C * g.H * g.W, s)
            for co in range(g.Co):
                _rows_copy(gz + co * s.gz_plane + s.lead, s.Wp,
                           dy + (n * g.Co + co) * g.Ho * g.Wo, g.Wo, g.Ho, g.Wo)
            if floating is float:
                direct_weight_grad_f(lanes, gz + s.lead, s.gz_plane, xp, s.plane, s.Wp, g.Co,
                                     g.C, g.kh, g.kw, s.Lq)
                if db != NULL:
                    direct_bias_grad_f(lanes + wsize * DIRECT_LANES, gz + s.lead, s.gz_plane,
                                       g.Co, s.Lq)
            else:
                direct_weight_grad_d(lanes, gz + s.lead, s.gz_plane, xp, s.plane, s.Wp, g.Co,
                                     g.C, g.kh, g.kw, s.Lq)
                if db != NULL:
                    direct_bias_grad_d(lanes + wsize * DIRECT_LANES, gz + s.lead, s.gz_plane,
                                       g.Co, s.Lq)
            if dx != NULL:
                _correlate(dxp, s.Lx, gz, s.gz_plane, s.Wp, flipped, NULL, g.C, g.Co, g.kh,
                           g.kw, s.Lx)
                for c in range(g.C):
                    _rows_copy(dx + (n * g.C + c) * g.H * g.W, g.W,
                               dxp + c * s.Lx + g.ph * s.Wp + g.pw, s.Wp, g.H, g.W)
    # dw, then db, += the lanes of every thread, in thread order, parallel over the weights.
    for k in prange(wsize + (g.Co if db != NULL else 0), schedule="static",
                    num_threads=s.threads, nogil=True):
        acc = 0
        for t in range(s.threads):
            for l in range(DIRECT_LANES):
                acc = acc + buffers[t * s.per_thread + lanes_at + k * DIRECT_LANES + l]
        if k < wsize:
            dw[k] += <floating> acc
        else:
            db[k - wsize] += <floating> acc


cdef bint _supports(const ConvGeometry* g) noexcept:
    return g.sh == 1 and g.sw == 1


cdef ConvAlgorithm _DIRECT = ConvAlgorithm(
    b"direct", b"stride 1", sizeof(DirectPlan), _supports, _plan,
    _forward[float], _forward[double], _backward[float], _backward[double])
algorithm = conv.Algorithm(algorithm_capsule(&_DIRECT))
forward, backward, supports = algorithm.forward, algorithm.backward, algorithm.supports
