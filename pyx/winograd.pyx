"""3x3 stride-1 convolution by Winograd F(2x2, 3x3): forward, weight/bias gradient, input gradient.

F(2x2, 3x3) (Lavin & Gray, 2016) makes each 2x2 output tile from a 4x4 input tile with 16
multiplications per (output, input) channel pair instead of 36. Per image the input is cut
into overlapping 4x4 tiles (stride 2); with U = G w G^T per channel pair and V = B^T d B per
tile and channel, the products for one of the 16 positions xi of a transformed tile are a
GEMM over channels, so a chunk of T tiles costs 16 GEMMs instead of one 2.25x larger one:
    forward:      M[xi] (C_out, T) = U[xi] (C_out, C_in) @ V[xi] (C_in, T)
                  y tile = A^T M A  (+ bias)
Backward is the adjoint of the same linear maps, so it needs no flipped-kernel convolution:
                  dM = A dy A^T                                       per tile
                  dU[xi] (C_out, C_in) += dM[xi] (C_out, T) @ V[xi]^T  ->  dw += G^T dU G
                  dV[xi] (C_in, T) = U[xi]^T (C_in, C_out) @ dM[xi]    ->  dx tile += B dV B^T

The transforms only add and halve (exact in binary except for rounding of the adds), so the
float32 result differs from im2col's by a few ulps of the operands' magnitude.

Parallelism is conv.pyx's: `prange` over groups of images, one BLAS thread per OpenMP thread,
thread-private tile buffers. Each thread sums its weight gradient in the transformed domain
(16 C_out C_in floats); the partial sums are added in fixed thread order, transformed back
and added to dw in parallel over output channels, so a run is deterministic for a given
thread count. The bias gradient is a separate parallel sum over output channels.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.string cimport memcpy, memset
cimport numpy as cnp
cimport openmp

from _blas cimport gemm
from _panels cimport (PANEL_GEMM_PREFERRED, Weights, panel_offset, panel_size,
                      panel_zero_padding_d, panel_zero_padding_f, times_weights,
                      weights_operand)
from _convargs cimport check_conv_backward, check_conv_forward
from _scratch cimport Scratch, scratch_give, scratch_take
from _validate cimport F32, FloatKind, check_blas_dim, check_pair, data

cnp.import_array()

cdef Scratch _scratch   # transformed weights, tile buffers and weight-gradient partials

# Tiles per GEMM below which images are batched together, and above which one image is cut
# into bands of tile rows (so the tile buffers of a large image stay a few MB).
DEF MIN_TILES = 256
DEF MAX_TILES = 1024
# Images per chunk from which the tile transforms run across the images (lane kernels)
# rather than along a row of tiles, which is then 4 tiles or fewer.
DEF LANES_MIN = 8


def winograd_supports(w_shape, stride=1):
    """Whether the Winograd kernels compute conv2d with this weight shape and stride: 3x3
    kernels at stride 1 (any padding, any image size)."""
    ws = tuple(w_shape)
    return (len(ws) == 4 and ws[2] == 3 and ws[3] == 3
            and check_pair("stride", stride, 1) == (1, 1))


# Where Winograd beats im2col/GEMM (`python -m perf kernels`, batch 64): on output planes of
# 16x16 and more 1.45-1.6x forward+backward, on 8x8 (lane kernels) 1.5-1.8x, on 4x4 1.2-1.4x.
# On 2x2 planes a tile is mostly padding and the GEMMs are 32 tiles wide (0.7x), and with a
# few input channels there is too little to multiply (3 channels: 0.9x).
DEF PREFERRED_MIN_CHANNELS = 16
DEF PREFERRED_MIN_PIXELS = 16


def winograd_preferred(x_shape, w_shape, stride=1, padding=0):
    """Whether a layer should run on the Winograd kernels rather than im2col/GEMM."""
    if not winograd_supports(w_shape, stride):
        return False
    ph, pw = check_pair("padding", padding, 0)
    xs = tuple(x_shape)
    pixels = (xs[2] + 2 * ph - 2) * (xs[3] + 2 * pw - 2)
    return xs[1] >= PREFERRED_MIN_CHANNELS and pixels >= PREFERRED_MIN_PIXELS


# ---- The weight transform, 1-D: G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1] and its transpose.
# The 2-D one applies it down the columns, then along the rows. Each reads its input at
# stride si and writes its output at stride so. (The tile transforms, B and A, are the row
# kernels of include/winograd_tiles.h.)

cdef inline void _g(floating* o, const floating* g, int si, int so) noexcept nogil:
    cdef floating g0 = g[0], g1 = g[si], g2 = g[2 * si]
    cdef floating even = <floating> 0.5 * (g0 + g2)
    o[0] = g0
    o[so] = even + <floating> 0.5 * g1
    o[2 * so] = even - <floating> 0.5 * g1
    o[3 * so] = g2


cdef inline void _gt(floating* o, const floating* u, int si, int so) noexcept nogil:
    cdef floating u0 = u[0], u1 = u[si], u2 = u[2 * si], u3 = u[3 * si]
    cdef floating half_sum = <floating> 0.5 * (u1 + u2)
    o[0] = u0 + half_sum
    o[so] = <floating> 0.5 * (u1 - u2)
    o[2 * so] = half_sum + u3


cdef struct WinoShape:
    Py_ssize_t N, C, H, W, Co, ph, pw, Ho, Wo
    Py_ssize_t th, tw   # tile rows and columns per image (2x2 output tiles)
    Py_ssize_t G        # images per chunk (> 1 only for small images)
    Py_ssize_t R        # tile rows per chunk when G == 1
    Py_ssize_t T        # tiles per chunk at most: G * R * tw
    bint lanes          # chunks of >= LANES_MIN images: lane kernels, images innermost
    Py_ssize_t Wp       # positions per row of a padded input plane: 2 * tw + 2


cdef WinoShape _plan(object xa, object wa, object padding, int* threads) except *:
    cdef WinoShape s
    s.N, s.C, s.H, s.W = (<object> xa).shape
    s.Co = (<object> wa).shape[0]
    s.ph, s.pw = check_pair("padding", padding, 0)
    s.Ho = s.H + 2 * s.ph - 2
    s.Wo = s.W + 2 * s.pw - 2
    s.th = (s.Ho + 1) // 2
    s.tw = (s.Wo + 1) // 2
    threads[0] = openmp.omp_get_max_threads()
    cdef Py_ssize_t per_image = s.th * s.tw
    cdef Py_ssize_t per_thread = (s.N + threads[0] - 1) // threads[0]
    s.G = (MIN_TILES + per_image - 1) // per_image
    if s.G > per_thread:
        s.G = per_thread
    if s.G < 1:
        s.G = 1
    s.R = s.th
    if s.G == 1 and per_image > MAX_TILES:
        s.R = MAX_TILES // s.tw if s.tw <= MAX_TILES else 1
        if s.R < 1:
            s.R = 1
    s.T = s.G * s.R * s.tw
    s.lanes = s.G >= LANES_MIN
    s.Wp = 2 * s.tw + 2
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    if threads[0] > groups:
        threads[0] = <int> groups
    check_blas_dim("winograd: C_in", s.C)
    check_blas_dim("winograd: C_out", s.Co)
    check_blas_dim("winograd: tiles per GEMM", s.T)
    return s


cdef inline void _transform_weight(floating* u, Py_ssize_t stride,
                                   const floating* w) noexcept nogil:
    """u[xi * stride] for the 16 positions xi = G w G^T of one channel pair's w (3, 3)."""
    cdef floating t[12]
    cdef floating v[16]
    cdef int k
    for k in range(3):
        _g(t + k, w + k, 3, 3)          # columns: t (4, 3) = G w
    for k in range(4):
        _g(v + 4 * k, t + 3 * k, 1, 1)  # rows: v = t G^T
    for k in range(16):
        u[k * stride] = v[k]


cdef inline void _add_weight_grad(floating* dw, const floating* partials, Py_ssize_t slot,
                                  Py_ssize_t stride, int threads) noexcept nogil:
    """dw (3, 3) += G^T du G, du[xi] the sum in thread order of partials[t*slot + xi*stride]."""
    cdef floating du[16]
    cdef floating t[12]
    cdef floating dg[9]
    cdef floating acc
    cdef int k, i
    for k in range(16):
        acc = 0
        for i in range(threads):
            acc = acc + partials[i * slot + k * stride]
        du[k] = acc
    for k in range(4):
        _gt(t + k, du + k, 4, 4)        # columns: t (3, 4) = G^T du
    for k in range(3):
        _gt(dg + 3 * k, t + 4 * k, 1, 1)
    for k in range(9):
        dw[k] += dg[k]


cdef bint _panels_enabled = PANEL_GEMM_PREFERRED


def set_panel_gemm(bint enabled):
    """Whether the products with the transformed weights run on dynar's panel GEMM (True)
    or on BLAS; returns the previous setting (as conv.set_panel_gemm)."""
    global _panels_enabled
    previous = _panels_enabled
    _panels_enabled = enabled
    return previous


cdef inline Py_ssize_t _u_stride(const WinoShape* s, bint panels, bint transposed) noexcept nogil:
    """Elements from u[xi] to u[xi + 1] (see _transform_weights)."""
    if not panels:
        return s.Co * s.C
    return panel_size(s.C, s.Co) if transposed else panel_size(s.Co, s.C)


cdef inline Py_ssize_t _u_size(const WinoShape* s) noexcept nogil:
    """Scratch for u in any of its layouts."""
    cdef Py_ssize_t a = _u_stride(s, _panels_enabled, False)
    cdef Py_ssize_t b = _u_stride(s, _panels_enabled, True)
    return 16 * (a if a > b else b)


cdef void _transform_weights(floating* u, const floating* w, const WinoShape* s, bint panels,
                             bint transposed, int threads) noexcept nogil:
    """u[xi] = (G w G^T)[xi] for every channel pair of w (C_out, C_in, 3, 3), xi < 16.

    Without panels u is (16, C_out, C_in). With them each u[xi] is written straight in the
    panel form of the GEMMs' left operand (include/panel_gemm.h), with no packing pass:
    (C_out, C_in) for the forward's, transposed (C_in, C_out) for the input gradient's."""
    cdef Py_ssize_t i, j, co, c, xi
    cdef Py_ssize_t stride = _u_stride(s, panels, transposed)
    # Rows of the layout written: input channels for the transposed panels, else outputs.
    cdef bint by_input = panels and transposed
    cdef Py_ssize_t m = s.C if by_input else s.Co
    cdef Py_ssize_t k = s.Co if by_input else s.C
    if panels:
        for xi in range(16):
            if floating is float:
                panel_zero_padding_f(u + xi * stride, m, k)
            else:
                panel_zero_padding_d(u + xi * stride, m, k)
    # Row by row of the layout: in panel form a thread's writes then fill whole cache
    # lines. Column by column they land a panel apart: the transform took 28% of the
    # backward pass of a 512 -> 512 layer at 4x4 (perf record), against 15% unpacked.
    for i in prange(m, schedule="static", num_threads=threads, nogil=True):
        for j in range(k):
            co = j if by_input else i
            c = i if by_input else j
            _transform_weight(u + (panel_offset(i, j, k) if panels else i * k + j),
                              stride, w + (co * s.C + c) * 9)


cdef extern from "winograd_tiles.h" nogil:
    void wino_input_columns_f(float* t, const float* d0, const float* d1, const float* d2,
                              const float* d3, Py_ssize_t W, Py_ssize_t pw, Py_ssize_t tw)
    void wino_input_columns_d(double* t, const double* d0, const double* d1, const double* d2,
                              const double* d3, Py_ssize_t W, Py_ssize_t pw, Py_ssize_t tw)
    void wino_input_row_f(float* v, Py_ssize_t stride, const float* t, Py_ssize_t tw)
    void wino_input_row_d(double* v, Py_ssize_t stride, const double* t, Py_ssize_t tw)
    void wino_output_row_f(float* y0, float* y1, const float* m, Py_ssize_t stride,
                           Py_ssize_t tw, float bias)
    void wino_output_row_d(double* y0, double* y1, const double* m, Py_ssize_t stride,
                           Py_ssize_t tw, double bias)
    void wino_output_grad_row_f(float* dm, Py_ssize_t stride, const float* g0, const float* g1,
                                Py_ssize_t tw)
    void wino_output_grad_row_d(double* dm, Py_ssize_t stride, const double* g0,
                                const double* g1, Py_ssize_t tw)
    void wino_input_grad_row_f(float* band, Py_ssize_t width, const float* dv,
                               Py_ssize_t stride, Py_ssize_t tw, float* t)
    void wino_input_grad_row_d(double* band, Py_ssize_t width, const double* dv,
                               Py_ssize_t stride, Py_ssize_t tw, double* t)
    void wino_lanes_input_f(float* v, Py_ssize_t stride, const float* xt, Py_ssize_t Wp,
                            Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)
    void wino_lanes_input_d(double* v, Py_ssize_t stride, const double* xt, Py_ssize_t Wp,
                            Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)
    void wino_lanes_output_f(float* yt, const float* m, Py_ssize_t stride, Py_ssize_t th,
                             Py_ssize_t tw, Py_ssize_t L, float bias)
    void wino_lanes_output_d(double* yt, const double* m, Py_ssize_t stride, Py_ssize_t th,
                             Py_ssize_t tw, Py_ssize_t L, double bias)
    void wino_lanes_output_grad_f(float* dm, Py_ssize_t stride, const float* dyt,
                                  Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)
    void wino_lanes_output_grad_d(double* dm, Py_ssize_t stride, const double* dyt,
                                  Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)
    void wino_lanes_input_grad_f(float* dxt, Py_ssize_t Wp, const float* dv, Py_ssize_t stride,
                                 Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)
    void wino_lanes_input_grad_d(double* dxt, Py_ssize_t Wp, const double* dv,
                                 Py_ssize_t stride, Py_ssize_t th, Py_ssize_t tw, Py_ssize_t L)


# The tile transforms work on one row of tiles at a time (the row kernels in
# include/winograd_tiles.h). A tile row reads 4 image rows, seen through a zero-padded "band"
# (band column k is image column k - pw) 2*tw + 2 wide: the width the last tile reaches.
# Per thread: 12 + 4 R band widths of scratch for the row kernels (the input transform
# keeps the column half of R tile rows).

cdef void _input_tiles(floating* v, Py_ssize_t ld, const floating* x, const WinoShape* s,
                       Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """v[xi, c, p] (16, C, ld) = B^T d B for tile rows [ty0, ty1) of one image x (C, H, W);
    p counts tiles from 0 row by row."""
    cdef Py_ssize_t width = 2 * s.tw + 2, c, ty, i, r
    cdef const floating* rows[4]
    cdef floating* zeros = band      # a row of the padding (the band is W or more wide)
    cdef floating* t = band + width  # the column transforms of every tile row
    memset(zeros, 0, width * sizeof(floating))
    for c in range(s.C):
        # Columns of every tile row first, then their rows: reading t back long after it
        # was written keeps the loads clear of the shifted stores still in flight.
        for ty in range(ty0, ty1):
            for i in range(4):
                r = 2 * ty - s.ph + i
                rows[i] = x + (c * s.H + r) * s.W if 0 <= r < s.H else zeros
            if floating is float:
                wino_input_columns_f(t + 4 * (ty - ty0) * width, rows[0], rows[1], rows[2],
                                     rows[3], s.W, s.pw, s.tw)
            else:
                wino_input_columns_d(t + 4 * (ty - ty0) * width, rows[0], rows[1], rows[2],
                                     rows[3], s.W, s.pw, s.tw)
        for ty in range(ty0, ty1):
            if floating is float:
                wino_input_row_f(v + c * ld + (ty - ty0) * s.tw, s.C * ld,
                                 t + 4 * (ty - ty0) * width, s.tw)
            else:
                wino_input_row_d(v + c * ld + (ty - ty0) * s.tw, s.C * ld,
                                 t + 4 * (ty - ty0) * width, s.tw)


cdef void _output_tiles(floating* y, const floating* m, Py_ssize_t ld, const floating* b,
                        const WinoShape* s, Py_ssize_t ty0, Py_ssize_t ty1,
                        floating* band) noexcept nogil:
    """y (C_out, Ho, Wo) of one image, tile rows [ty0, ty1) = A^T m A (+ b)."""
    cdef Py_ssize_t width = 2 * s.tw, co, ty, i
    cdef const floating* mt
    cdef floating* y0
    cdef floating* y1
    cdef bint direct
    for co in range(s.Co):
        mt = m + co * ld
        for ty in range(ty0, ty1):
            # Straight into y where both output rows exist in full; else through the band.
            direct = s.Wo == width and 2 * ty + 1 < s.Ho
            y0 = y + (co * s.Ho + 2 * ty) * s.Wo if direct else band
            y1 = y0 + s.Wo if direct else band + width
            if floating is float:
                wino_output_row_f(y0, y1, mt, s.Co * ld, s.tw, b[co] if b != NULL else 0)
            else:
                wino_output_row_d(y0, y1, mt, s.Co * ld, s.tw, b[co] if b != NULL else 0)
            if not direct:
                for i in range(2):
                    if 2 * ty + i < s.Ho:
                        memcpy(y + (co * s.Ho + 2 * ty + i) * s.Wo, band + i * width,
                               s.Wo * sizeof(floating))
            mt += s.tw


cdef void _output_grad_tiles(floating* dm, Py_ssize_t ld, const floating* dy, const WinoShape* s,
                             Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """dm[xi, co, p] (16, C_out, ld) = A g A^T for tile rows [ty0, ty1) of one image's
    dy (C_out, Ho, Wo); outputs past an odd edge count as zero."""
    cdef Py_ssize_t width = 2 * s.tw, co, ty, i
    cdef floating* out
    cdef const floating* g0
    cdef const floating* g1
    for co in range(s.Co):
        out = dm + co * ld
        for ty in range(ty0, ty1):
            if s.Wo == width and 2 * ty + 1 < s.Ho:
                g0 = dy + (co * s.Ho + 2 * ty) * s.Wo
                g1 = g0 + s.Wo
            else:
                memset(band, 0, 2 * width * sizeof(floating))
                for i in range(2):
                    if 2 * ty + i < s.Ho:
                        memcpy(band + i * width, dy + (co * s.Ho + 2 * ty + i) * s.Wo,
                               s.Wo * sizeof(floating))
                g0 = band
                g1 = band + width
            if floating is float:
                wino_output_grad_row_f(out, s.Co * ld, g0, g1, s.tw)
            else:
                wino_output_grad_row_d(out, s.Co * ld, g0, g1, s.tw)
            out += s.tw


cdef void _input_grad_tiles(floating* dx, const floating* dv, Py_ssize_t ld, const WinoShape* s,
                            Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """dx (C, H, W) of one image += B dv B^T of tile rows [ty0, ty1), each added back where
    its patch was read (the adjoint of _input_tiles; padding positions are dropped)."""
    cdef Py_ssize_t width = 2 * s.tw + 2, c, ty, i, k, r
    cdef Py_ssize_t n = s.W if s.W < width - s.pw else width - s.pw
    cdef const floating* vt
    cdef floating* row
    cdef floating* dst
    for c in range(s.C):
        vt = dv + c * ld
        for ty in range(ty0, ty1):
            if floating is float:
                wino_input_grad_row_f(band, width, vt, s.C * ld, s.tw, band + 4 * width)
            else:
                wino_input_grad_row_d(band, width, vt, s.C * ld, s.tw, band + 4 * width)
            for i in range(4):
                r = 2 * ty - s.ph + i
                if 0 <= r < s.H:
                    row = band + i * width + s.pw
                    dst = dx + (c * s.H + r) * s.W
                    for k in range(n):
                        dst[k] += row[k]
            vt += s.tw


# ---- A chunk of images: rows of tiles image by image, or all images at once in lanes ----
# Both layouts hold the chunk's tiles as the columns of its GEMMs; they differ in the column
# order (rows: image-major, lanes: image innermost), which the four transforms of a chunk
# share. A lane plane is position-major with the chunk's gn images innermost.

cdef void _chunk_input(floating* v, Py_ssize_t ld, const floating* x, const WinoShape* s,
                       Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                       floating* plane) noexcept nogil:
    """v (16, C, ld) = the input tiles of images x[0:gn], tile rows [ty0, ty1)."""
    cdef Py_ssize_t c, g, r, q, image = s.C * s.H * s.W
    cdef floating* dst
    if not s.lanes:
        for g in range(gn):
            _input_tiles(v + g * (ty1 - ty0) * s.tw, ld, x + g * image, s, ty0, ty1, band)
        return
    for c in range(s.C):
        memset(plane, 0, (2 * s.th + 2) * s.Wp * gn * sizeof(floating))
        for g in range(gn):
            for r in range(s.H):
                dst = plane + ((r + s.ph) * s.Wp + s.pw) * gn + g
                for q in range(s.W):
                    dst[q * gn] = x[g * image + (c * s.H + r) * s.W + q]
        if floating is float:
            wino_lanes_input_f(v + c * ld, s.C * ld, plane, s.Wp, s.th, s.tw, gn)
        else:
            wino_lanes_input_d(v + c * ld, s.C * ld, plane, s.Wp, s.th, s.tw, gn)


cdef void _chunk_output(floating* y, const floating* m, Py_ssize_t ld, const floating* b,
                        const WinoShape* s, Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1,
                        floating* band, floating* plane) noexcept nogil:
    """y[0:gn] (C_out, Ho, Wo), tile rows [ty0, ty1) = A^T m A (+ b)."""
    cdef Py_ssize_t co, g, oh, ow, image = s.Co * s.Ho * s.Wo
    cdef floating* dst
    if not s.lanes:
        for g in range(gn):
            _output_tiles(y + g * image, m + g * (ty1 - ty0) * s.tw, ld, b, s, ty0, ty1, band)
        return
    for co in range(s.Co):
        if floating is float:
            wino_lanes_output_f(plane, m + co * ld, s.Co * ld, s.th, s.tw, gn,
                                b[co] if b != NULL else 0)
        else:
            wino_lanes_output_d(plane, m + co * ld, s.Co * ld, s.th, s.tw, gn,
                                b[co] if b != NULL else 0)
        for g in range(gn):
            for oh in range(s.Ho):
                dst = y + g * image + (co * s.Ho + oh) * s.Wo
                for ow in range(s.Wo):
                    dst[ow] = plane[(oh * 2 * s.tw + ow) * gn + g]


cdef void _chunk_output_grad(floating* dm, Py_ssize_t ld, const floating* dy, const WinoShape* s,
                             Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                             floating* plane) noexcept nogil:
    """dm (16, C_out, ld) = A dy A^T for the tiles of images dy[0:gn], tile rows [ty0, ty1)."""
    cdef Py_ssize_t co, g, oh, ow, image = s.Co * s.Ho * s.Wo
    cdef floating* dst
    if not s.lanes:
        for g in range(gn):
            _output_grad_tiles(dm + g * (ty1 - ty0) * s.tw, ld, dy + g * image, s, ty0, ty1,
                               band)
        return
    for co in range(s.Co):
        memset(plane, 0, 4 * s.th * s.tw * gn * sizeof(floating))
        for g in range(gn):
            for oh in range(s.Ho):
                dst = plane + oh * 2 * s.tw * gn + g
                for ow in range(s.Wo):
                    dst[ow * gn] = dy[g * image + (co * s.Ho + oh) * s.Wo + ow]
        if floating is float:
            wino_lanes_output_grad_f(dm + co * ld, s.Co * ld, plane, s.th, s.tw, gn)
        else:
            wino_lanes_output_grad_d(dm + co * ld, s.Co * ld, plane, s.th, s.tw, gn)


cdef void _chunk_input_grad(floating* dx, const floating* dv, Py_ssize_t ld, const WinoShape* s,
                            Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                            floating* plane) noexcept nogil:
    """dx[0:gn] (C, H, W) += B dv B^T of the chunk's tiles (tile rows [ty0, ty1))."""
    cdef Py_ssize_t c, g, r, q, image = s.C * s.H * s.W
    cdef floating* dst
    if not s.lanes:
        for g in range(gn):
            _input_grad_tiles(dx + g * image, dv + g * (ty1 - ty0) * s.tw, ld, s, ty0, ty1,
                              band)
        return
    for c in range(s.C):
        memset(plane, 0, (2 * s.th + 2) * s.Wp * gn * sizeof(floating))
        if floating is float:
            wino_lanes_input_grad_f(plane, s.Wp, dv + c * ld, s.C * ld, s.th, s.tw, gn)
        else:
            wino_lanes_input_grad_d(plane, s.Wp, dv + c * ld, s.C * ld, s.th, s.tw, gn)
        for g in range(gn):
            for r in range(s.H):
                dst = dx + g * image + (c * s.H + r) * s.W
                for q in range(s.W):
                    dst[q] += plane[((r + s.ph) * s.Wp + s.pw + q) * gn + g]


cdef inline Py_ssize_t _chunk_tiles(const WinoShape* s, Py_ssize_t gn, Py_ssize_t ty0,
                                    Py_ssize_t ty1) noexcept nogil:
    return gn * (ty1 - ty0) * s.tw


cdef inline Py_ssize_t _workspace_per_thread(const WinoShape* s) noexcept nogil:
    # the transformed input tiles and the products (or output-gradient tiles), then bands,
    # then a lane plane
    return (16 * (s.C + s.Co) * s.T + (12 + 4 * s.R) * (2 * s.tw + 2)
            + ((2 * s.th + 2) * s.Wp * s.G if s.lanes else 0))


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   WinoShape s, floating* u, floating* work, int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t per_thread = _workspace_per_thread(&s)
    cdef Py_ssize_t grp, n0, gn, ty0, ty1, ld, xi
    cdef floating* v = NULL
    cdef floating* m = NULL
    cdef floating* band = NULL
    cdef floating* plane = NULL
    cdef bint panels = _panels_enabled
    cdef Py_ssize_t u_stride = _u_stride(&s, panels, False)
    cdef Weights a
    _transform_weights(u, w, &s, panels, False, threads)
    with parallel(num_threads=threads):
        v = work + threadid() * per_thread
        m = v + 16 * s.C * s.T
        band = m + 16 * s.Co * s.T
        plane = band + (12 + 4 * s.R) * (2 * s.tw + 2)
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            ty0 = 0
            while ty0 < s.th:
                ty1 = ty0 + s.R if ty0 + s.R < s.th else s.th
                ld = _chunk_tiles(&s, gn, ty0, ty1)
                _chunk_input(v, ld, x + n0 * s.C * s.H * s.W, &s, gn, ty0, ty1, band, plane)
                for xi in range(16):
                    a = weights_operand(s.Co, s.C, False, u + xi * u_stride if panels else NULL)
                    times_weights(m + xi * s.Co * ld, ld, &a, u + xi * u_stride,
                                  v + xi * s.C * ld, ld, ld, NULL)
                _chunk_output(y + n0 * s.Co * s.Ho * s.Wo, m, ld, b, &s, gn, ty0, ty1, band,
                              plane)
                ty0 = ty1


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, WinoShape s, floating* u,
                    floating* partials, floating* work, int threads) noexcept nogil:
    cdef Py_ssize_t groups = (s.N + s.G - 1) // s.G
    cdef Py_ssize_t per_thread = _workspace_per_thread(&s)
    cdef Py_ssize_t slot = 16 * s.Co * s.C
    cdef Py_ssize_t grp, n0, gn, ty0, ty1, ld, xi, co, c, n, i
    cdef floating* v = NULL
    cdef floating* dm = NULL
    cdef floating* du = NULL
    cdef floating* band = NULL
    cdef floating* plane = NULL
    cdef double bias_acc
    cdef floating beta
    cdef bint panels = _panels_enabled
    cdef Py_ssize_t u_stride = _u_stride(&s, panels, True)
    cdef Weights a
    # started[t]: 1 once thread t wrote its partial sum. Its first chunk overwrites the
    # partial (no zeroing pass over threads x 16 x C_out x C_in), later chunks add.
    cdef floating* started = partials + threads * slot
    memset(started, 0, threads * sizeof(floating))
    _transform_weights(u, w, &s, panels, True, threads)
    with parallel(num_threads=threads):
        v = work + threadid() * per_thread
        dm = v + 16 * s.C * s.T
        band = dm + 16 * s.Co * s.T
        plane = band + (12 + 4 * s.R) * (2 * s.tw + 2)
        du = partials + threadid() * slot
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= s.N else s.N - n0
            if dx != NULL:
                memset(dx + n0 * s.C * s.H * s.W, 0, gn * s.C * s.H * s.W * sizeof(floating))
            ty0 = 0
            while ty0 < s.th:
                ty1 = ty0 + s.R if ty0 + s.R < s.th else s.th
                ld = _chunk_tiles(&s, gn, ty0, ty1)
                _chunk_input(v, ld, x + n0 * s.C * s.H * s.W, &s, gn, ty0, ty1, band, plane)
                _chunk_output_grad(dm, ld, dy + n0 * s.Co * s.Ho * s.Wo, &s, gn, ty0, ty1, band,
                                   plane)
                beta = started[threadid()]
                started[threadid()] = 1
                for xi in range(16):
                    gemm(False, True, <int> s.Co, <int> s.C, <int> ld, <floating> 1,
                         dm + xi * s.Co * ld, <int> ld, v + xi * s.C * ld, <int> ld,
                         beta, du + xi * s.Co * s.C, <int> s.C)
                    if dx != NULL:
                        # dV overwrites V: this position's weight-gradient GEMM consumed it.
                        a = weights_operand(s.Co, s.C, True,
                                            u + xi * u_stride if panels else NULL)
                        times_weights(v + xi * s.C * ld, ld, &a, u + xi * u_stride,
                                      dm + xi * s.Co * ld, ld, ld, NULL)
                if dx != NULL:
                    _chunk_input_grad(dx + n0 * s.C * s.H * s.W, v, ld, &s, gn, ty0, ty1, band,
                                      plane)
                ty0 = ty1
    # dw += G^T (sum of the threads' partials, in thread order) G, parallel over C_out.
    for co in prange(s.Co, schedule="static", num_threads=threads, nogil=True):
        for c in range(s.C):
            _add_weight_grad(dw + (co * s.C + c) * 9, partials + co * s.C + c, slot,
                             s.Co * s.C, threads)
    if db != NULL:
        for co in prange(s.Co, schedule="static", num_threads=threads, nogil=True):
            bias_acc = 0
            for n in range(s.N):
                for i in range(s.Ho * s.Wo):
                    bias_acc = bias_acc + dy[(n * s.Co + co) * s.Ho * s.Wo + i]
            db[co] += <floating> bias_acc


cdef _require_supported(object wa, object stride):
    if not winograd_supports((<object> wa).shape, stride):
        raise ValueError(f"winograd: needs a 3x3 kernel at stride 1, got kernel "
                         f"{(<object> wa).shape[2:]} and stride {stride!r}")


def winograd_forward(y, x, w, b=None, padding=1):
    """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, 3, 3)) + b,
    stride 1; the same contract as conv.conv2d_forward. y is overwritten; b may be None."""
    cdef FloatKind kind = F32
    ya, xa, wa, ba = check_conv_forward(y, x, w, b, 1, padding, &kind)
    _require_supported(wa, 1)
    cdef int threads
    cdef WinoShape s = _plan(xa, wa, padding, &threads)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t u_size = _u_size(&s)
    cdef bint private
    cdef void* work = scratch_take(
        &_scratch, (u_size + threads * _workspace_per_thread(&s)) * itemsize, &private)
    cdef void* yp = data(ya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef void* bp = data(ba)
    try:
        with nogil:
            if kind == F32:
                _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp, s,
                         <float*> work, <float*> work + u_size, threads)
            else:
                _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp, s,
                         <double*> work, <double*> work + u_size, threads)
    finally:
        scratch_give(&_scratch, work, private)


def winograd_backward(dx, dw, db, dy, x, w, padding=1):
    """Gradients of winograd_forward given dy; the same contract as conv.conv2d_backward:
    dx is overwritten (None skips it), dw and db are accumulated into (db may be None)."""
    cdef FloatKind kind = F32
    dxa, dwa, dba, dya, xa, wa = check_conv_backward(dx, dw, db, dy, x, w, 1, padding, &kind)
    _require_supported(wa, 1)
    cdef int threads
    cdef WinoShape s = _plan(xa, wa, padding, &threads)
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef Py_ssize_t u_size = _u_size(&s)
    cdef Py_ssize_t partials_size = 16 * s.Co * s.C * threads
    cdef bint private
    # transformed weights, per-thread partial weight gradients and their `started` flags,
    # per-thread tile buffers
    cdef Py_ssize_t size = u_size + partials_size + threads + threads * _workspace_per_thread(&s)
    cdef void* work = scratch_take(&_scratch, size * itemsize, &private)
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
                          <float*> wp, s, <float*> work, <float*> work + u_size,
                          <float*> work + u_size + partials_size + threads, threads)
            else:
                _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                          <double*> xp, <double*> wp, s, <double*> work,
                          <double*> work + u_size,
                          <double*> work + u_size + partials_size + threads, threads)
    finally:
        scratch_give(&_scratch, work, private)
