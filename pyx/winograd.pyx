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

Parallelism is im2col's: `prange` over groups of images, one BLAS thread per OpenMP thread,
thread-private tile buffers. Each thread sums its weight gradient in the transformed domain
(16 C_out C_in floats); the partial sums are added in fixed thread order, transformed back
and added to dw in parallel over output channels, so a run is deterministic for a given
thread count. The bias gradient is a separate parallel sum over blocks of output channels,
each channel's in an order fixed by the shape.

Entry points: `forward`, `backward`, `supports` (conv.Algorithm); 3x3 kernels at stride 1,
any padding and image size.
"""
from cython cimport floating
from cython.parallel cimport prange, parallel, threadid
from libc.stdint cimport uint16_t
from libc.string cimport memcpy, memset
cimport numpy as cnp

from _blas cimport gemm
from _conv_call cimport ConvAlgorithm, ConvCall, ConvGeometry, algorithm_capsule
from _panels cimport (BF16_BLOCK_PAIRS, BF16_PANEL_ROWS, PANEL_ROWS, Weights, bf16_gemm_nt,
                      bf16_panel_offset, bf16_panel_size, bf16_panel_zero_padding,
                      panel_offset, panel_size, panel_zero_padding_d, panel_zero_padding_f,
                      times_weights, weights_operand)
from _lane_sums cimport MAX_BLOCK, channel_block, channel_sums
from _parallel cimport threads_for
from _validate cimport F32, check_blas_dim

from dynar.kernels import conv

cnp.import_array()

# Tiles per GEMM below which images are batched together, and above which one image is cut
# into bands of tile rows (so the tile buffers of a large image stay a few MB).
DEF MIN_TILES = 256
DEF MAX_TILES = 1024
# Images per chunk from which the tile transforms run across the images (lane kernels)
# rather than along a row of tiles, which is then 4 tiles or fewer.
DEF LANES_MIN = 8


cdef struct WinogradPlan:
    ConvGeometry g
    int threads
    Py_ssize_t th, tw   # tile rows and columns per image (2x2 output tiles)
    Py_ssize_t G        # images per chunk (> 1 only for small images)
    Py_ssize_t R        # tile rows per chunk when G == 1
    Py_ssize_t T        # tiles per chunk at most: G * R * tw
    bint lanes          # chunks of >= LANES_MIN images: lane kernels, images innermost
    Py_ssize_t Wp       # positions per row of a padded input plane: 2 * tw + 2
    Py_ssize_t panels   # the products with the transformed weights on the panel GEMM
                        # (ConvCall.panel_block), 0: on BLAS
    int bf16            # ... on its bf16 panels and this kernel (ConvCall.bf16): u rounded
                        # to bf16 as it is transformed, the transformed input and output
                        # gradient tiles as the GEMM reads them
    # The workspace: the transformed weights u (u_size), then in backward the threads'
    # partial weight gradients and their `started` flags (partials_size), then every
    # thread's tile buffers (per_thread).
    Py_ssize_t u_size, partials_size, per_thread, lane_plane


# A chunk's transformed tiles (and products, gradients) are 16 position blocks of `rows` x ld
# values, one after another. A tile's transform writes (and the output transform reads) all
# 16 at once: at a stride that is a multiple of 4 KB, as rows x ld often is, every one of
# them falls in the same set of the L1 and L2 caches, which hold 8 to 16 ways, and they evict
# each other. A cache line's padding after each block puts them in 16 sets.
DEF POSITION_PAD = 16


cdef inline Py_ssize_t _position_stride(Py_ssize_t rows, Py_ssize_t ld) noexcept nogil:
    """Values from one position's block of a chunk to the next: rows x ld, padded."""
    return rows * ld + POSITION_PAD


cdef Py_ssize_t _plan(const ConvCall* c, void* plan) except -1:
    cdef WinogradPlan* s = <WinogradPlan*> plan
    cdef const ConvGeometry* g = &c.g
    s.g = c.g
    s.th = (g.Ho + 1) // 2
    s.tw = (g.Wo + 1) // 2
    cdef Py_ssize_t per_image = s.th * s.tw
    cdef int threads = threads_for(g.N)
    cdef Py_ssize_t per_thread = (g.N + threads - 1) // threads
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
    s.threads = threads_for((g.N + s.G - 1) // s.G)
    check_blas_dim("winograd: C_in", g.C)
    check_blas_dim("winograd: C_out", g.Co)
    check_blas_dim("winograd: tiles per GEMM", s.T)
    s.panels = c.panel_block
    s.bf16 = c.bf16
    s.u_size = _u_size(s)
    s.partials_size = (16 * g.Co * g.C + 1) * s.threads if c.backward else 0
    # the transformed input tiles and the products (or output-gradient tiles), then bands,
    # then a lane plane, then (bf16 backward) the weight gradient's packed operand
    s.lane_plane = (2 * s.th + 2) * s.Wp * s.G if s.lanes else 0
    s.per_thread = (16 * (_position_stride(g.C, s.T) + _position_stride(g.Co, s.T))
                    + (12 + 4 * s.R) * (2 * s.tw + 2) + s.lane_plane)
    if c.backward and s.bf16:    # the weight gradient's packed dM
        s.per_thread += (bf16_panel_size(g.Co, s.T) + 1) // 2
    return (s.u_size + s.partials_size + s.threads * s.per_thread) * (4 if c.kind == F32 else 8)


cdef inline Py_ssize_t _u_stride(const WinogradPlan* s, bint transposed) noexcept nogil:
    """Elements from u[xi] to u[xi + 1] (see _transform_weights); for bf16 panels, the
    floats their halves fill. Padded as a chunk's positions are (_position_stride)."""
    if not s.panels:
        return _position_stride(s.g.Co, s.g.C)
    if s.bf16:   # (an even count of halves)
        return _position_stride(1, (bf16_panel_size(s.g.C, s.g.Co) if transposed
                                    else bf16_panel_size(s.g.Co, s.g.C)) // 2)
    return _position_stride(1, panel_size(s.g.C, s.g.Co) if transposed
                            else panel_size(s.g.Co, s.g.C))


cdef inline Py_ssize_t _u_size(const WinogradPlan* s) noexcept nogil:
    """Workspace for u in either of its layouts."""
    cdef Py_ssize_t a = _u_stride(s, False)
    cdef Py_ssize_t b = _u_stride(s, True)
    return 16 * (a if a > b else b)


cdef extern from "winograd_tiles.h" nogil:
    void wino_weights_f(float* u, Py_ssize_t stride, const float* w, Py_ssize_t w_step,
                        Py_ssize_t count)
    void wino_weights_d(double* u, Py_ssize_t stride, const double* w, Py_ssize_t w_step,
                        Py_ssize_t count)
    void wino_weight_grads_f(float* dw, float* partials, Py_ssize_t slot,
                             Py_ssize_t stride, int threads, Py_ssize_t count)
    void wino_weight_grads_d(double* dw, double* partials, Py_ssize_t slot,
                             Py_ssize_t stride, int threads, Py_ssize_t count)
    void wino_weights_bf16(uint16_t* u, Py_ssize_t stride, const float* w,
                           Py_ssize_t w_step, Py_ssize_t count)


cdef inline void _wino_weights(floating* u, Py_ssize_t stride, const floating* w,
                               Py_ssize_t w_step, Py_ssize_t count) noexcept nogil:
    if floating is float:
        wino_weights_f(u, stride, w, w_step, count)
    else:
        wino_weights_d(u, stride, w, w_step, count)


cdef void _transform_weights(floating* u, const floating* w, const WinogradPlan* s,
                             bint transposed) noexcept nogil:
    """u[xi] = (G w G^T)[xi] for every channel pair of w (C_out, C_in, 3, 3), xi < 16.

    Without panels u is (16, C_out, C_in). With them each u[xi] is written straight in the
    panel form of the GEMMs' left operand (include/panel_gemm.h, or panel_gemm_bf16.h's bf16
    panels), with no packing pass: (C_out, C_in) for the forward's, transposed (C_in, C_out)
    for the input gradient's."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t j, xi
    cdef bint panels = s.panels
    cdef Py_ssize_t stride = _u_stride(s, transposed)
    # Rows of the layout written: input channels for the transposed panels, else outputs.
    cdef bint by_input = panels and transposed
    cdef Py_ssize_t m = g.C if by_input else g.Co
    cdef Py_ssize_t k = g.Co if by_input else g.C
    cdef bint bf16 = floating is float and s.bf16
    if bf16:
        for xi in range(16):
            bf16_panel_zero_padding(<uint16_t*> (u + xi * stride), m, k)
        stride *= 2   # halves
    elif panels:
        for xi in range(16):
            if floating is float:
                panel_zero_padding_f(u + xi * stride, m, k)
            else:
                panel_zero_padding_d(u + xi * stride, m, k)
    # Vectorized across a panel's rows (without panels: across a row; bf16 panels: along a
    # row's depth block, where its halves are adjacent), each thread writing whole panels:
    # their cache lines fill in one thread
    # (docs/notes/2026-12-02-kernels.md, "Winograd's weight transform").
    cdef Py_ssize_t rows = (BF16_PANEL_ROWS if bf16 else PANEL_ROWS) if panels else 1
    cdef Py_ssize_t w_row = 9 if by_input else g.C * 9     # from one row's kernels to the next
    cdef Py_ssize_t w_col = g.C * 9 if by_input else 9
    cdef Py_ssize_t p, i0, i, count
    cdef Py_ssize_t block = 2 * BF16_BLOCK_PAIRS   # halves of a row adjacent in a bf16 panel
    for p in prange((m + rows - 1) // rows, schedule="static", num_threads=s.threads,
                    nogil=True):
        i0 = p * rows
        count = m - i0 if m - i0 < rows else rows
        if not panels:
            _wino_weights(u + i0 * k, stride, w + i0 * w_row, w_col, k)
        elif bf16:
            for i in range(i0, i0 + count):
                j = 0
                while j < k:
                    wino_weights_bf16(<uint16_t*> u + bf16_panel_offset(i, j, k), stride,
                                      <const float*> (w + i * w_row + j * w_col), w_col,
                                      min(k - j, block))
                    j = j + block
        else:
            for j in range(k):
                # A panel's rows are adjacent in it.
                _wino_weights(u + panel_offset(i0, j, k), stride, w + i0 * w_row + j * w_col,
                              w_row, count)


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

cdef void _input_tiles(floating* v, Py_ssize_t ld, const floating* x, const WinogradPlan* s,
                       Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """v[xi, c, p] (16, C, ld) = B^T d B for tile rows [ty0, ty1) of one image x (C, H, W);
    p counts tiles from 0 row by row."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t v_step = _position_stride(g.C, ld)
    cdef Py_ssize_t width = 2 * s.tw + 2, c, ty, i, r
    cdef const floating* rows[4]
    cdef floating* zeros = band      # a row of the padding (the band is W or more wide)
    cdef floating* t = band + width  # the column transforms of every tile row
    memset(zeros, 0, width * sizeof(floating))
    for c in range(g.C):
        # Columns of every tile row first, then their rows: reading t back long after it
        # was written keeps the loads clear of the shifted stores still in flight.
        for ty in range(ty0, ty1):
            for i in range(4):
                r = 2 * ty - g.ph + i
                rows[i] = x + (c * g.H + r) * g.W if 0 <= r < g.H else zeros
            if floating is float:
                wino_input_columns_f(t + 4 * (ty - ty0) * width, rows[0], rows[1], rows[2],
                                     rows[3], g.W, g.pw, s.tw)
            else:
                wino_input_columns_d(t + 4 * (ty - ty0) * width, rows[0], rows[1], rows[2],
                                     rows[3], g.W, g.pw, s.tw)
        for ty in range(ty0, ty1):
            if floating is float:
                wino_input_row_f(v + c * ld + (ty - ty0) * s.tw, v_step,
                                 t + 4 * (ty - ty0) * width, s.tw)
            else:
                wino_input_row_d(v + c * ld + (ty - ty0) * s.tw, v_step,
                                 t + 4 * (ty - ty0) * width, s.tw)


cdef void _output_tiles(floating* y, const floating* m, Py_ssize_t ld, const floating* b,
                        const WinogradPlan* s, Py_ssize_t ty0, Py_ssize_t ty1,
                        floating* band) noexcept nogil:
    """y (C_out, Ho, Wo) of one image, tile rows [ty0, ty1) = A^T m A (+ b)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t m_step = _position_stride(g.Co, ld)
    cdef Py_ssize_t width = 2 * s.tw, co, ty, i
    cdef const floating* mt
    cdef floating* y0
    cdef floating* y1
    cdef bint direct
    for co in range(g.Co):
        mt = m + co * ld
        for ty in range(ty0, ty1):
            # Straight into y where both output rows exist in full; else through the band.
            direct = g.Wo == width and 2 * ty + 1 < g.Ho
            y0 = y + (co * g.Ho + 2 * ty) * g.Wo if direct else band
            y1 = y0 + g.Wo if direct else band + width
            if floating is float:
                wino_output_row_f(y0, y1, mt, m_step, s.tw, b[co] if b != NULL else 0)
            else:
                wino_output_row_d(y0, y1, mt, m_step, s.tw, b[co] if b != NULL else 0)
            if not direct:
                for i in range(2):
                    if 2 * ty + i < g.Ho:
                        memcpy(y + (co * g.Ho + 2 * ty + i) * g.Wo, band + i * width,
                               g.Wo * sizeof(floating))
            mt += s.tw


cdef void _output_grad_tiles(floating* dm, Py_ssize_t ld, const floating* dy, const WinogradPlan* s,
                             Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """dm[xi, co, p] (16, C_out, ld) = A g A^T for tile rows [ty0, ty1) of one image's
    dy (C_out, Ho, Wo); outputs past an odd edge count as zero."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t m_step = _position_stride(g.Co, ld)
    cdef Py_ssize_t width = 2 * s.tw, co, ty, i
    cdef floating* out
    cdef const floating* g0
    cdef const floating* g1
    for co in range(g.Co):
        out = dm + co * ld
        for ty in range(ty0, ty1):
            if g.Wo == width and 2 * ty + 1 < g.Ho:
                g0 = dy + (co * g.Ho + 2 * ty) * g.Wo
                g1 = g0 + g.Wo
            else:
                memset(band, 0, 2 * width * sizeof(floating))
                for i in range(2):
                    if 2 * ty + i < g.Ho:
                        memcpy(band + i * width, dy + (co * g.Ho + 2 * ty + i) * g.Wo,
                               g.Wo * sizeof(floating))
                g0 = band
                g1 = band + width
            if floating is float:
                wino_output_grad_row_f(out, m_step, g0, g1, s.tw)
            else:
                wino_output_grad_row_d(out, m_step, g0, g1, s.tw)
            out += s.tw


cdef void _input_grad_tiles(floating* dx, const floating* dv, Py_ssize_t ld, const WinogradPlan* s,
                            Py_ssize_t ty0, Py_ssize_t ty1, floating* band) noexcept nogil:
    """dx (C, H, W) of one image += B dv B^T of tile rows [ty0, ty1), each added back where
    its patch was read (the adjoint of _input_tiles; padding positions are dropped)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t v_step = _position_stride(g.C, ld)
    cdef Py_ssize_t width = 2 * s.tw + 2, c, ty, i, k, r
    cdef Py_ssize_t n = g.W if g.W < width - g.pw else width - g.pw
    cdef const floating* vt
    cdef floating* row
    cdef floating* dst
    for c in range(g.C):
        vt = dv + c * ld
        for ty in range(ty0, ty1):
            if floating is float:
                wino_input_grad_row_f(band, width, vt, v_step, s.tw, band + 4 * width)
            else:
                wino_input_grad_row_d(band, width, vt, v_step, s.tw, band + 4 * width)
            for i in range(4):
                r = 2 * ty - g.ph + i
                if 0 <= r < g.H:
                    row = band + i * width + g.pw
                    dst = dx + (c * g.H + r) * g.W
                    for k in range(n):
                        dst[k] += row[k]
            vt += s.tw


# ---- A chunk of images: rows of tiles image by image, or all images at once in lanes ----
# Both layouts hold the chunk's tiles as the columns of its GEMMs; they differ in the column
# order (rows: image-major, lanes: image innermost), which the four transforms of a chunk
# share. A lane plane is position-major with the chunk's gn images innermost.

cdef void _chunk_input(floating* v, Py_ssize_t ld, const floating* x, const WinogradPlan* s,
                       Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                       floating* plane) noexcept nogil:
    """v (16, C, ld) = the input tiles of images x[0:gn], tile rows [ty0, ty1)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t v_step = _position_stride(g.C, ld)
    cdef Py_ssize_t c, n, r, q, image = g.C * g.H * g.W
    cdef floating* dst
    if not s.lanes:
        for n in range(gn):
            _input_tiles(v + n * (ty1 - ty0) * s.tw, ld, x + n * image, s, ty0, ty1, band)
        return
    for c in range(g.C):
        memset(plane, 0, (2 * s.th + 2) * s.Wp * gn * sizeof(floating))
        for n in range(gn):
            for r in range(g.H):
                dst = plane + ((r + g.ph) * s.Wp + g.pw) * gn + n
                for q in range(g.W):
                    dst[q * gn] = x[n * image + (c * g.H + r) * g.W + q]
        if floating is float:
            wino_lanes_input_f(v + c * ld, v_step, plane, s.Wp, s.th, s.tw, gn)
        else:
            wino_lanes_input_d(v + c * ld, v_step, plane, s.Wp, s.th, s.tw, gn)


cdef void _chunk_output(floating* y, const floating* m, Py_ssize_t ld, const floating* b,
                        const WinogradPlan* s, Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1,
                        floating* band, floating* plane) noexcept nogil:
    """y[0:gn] (C_out, Ho, Wo), tile rows [ty0, ty1) = A^T m A (+ b)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t m_step = _position_stride(g.Co, ld)
    cdef Py_ssize_t co, n, oh, ow, image = g.Co * g.Ho * g.Wo
    cdef floating* dst
    if not s.lanes:
        for n in range(gn):
            _output_tiles(y + n * image, m + n * (ty1 - ty0) * s.tw, ld, b, s, ty0, ty1, band)
        return
    for co in range(g.Co):
        if floating is float:
            wino_lanes_output_f(plane, m + co * ld, m_step, s.th, s.tw, gn,
                                b[co] if b != NULL else 0)
        else:
            wino_lanes_output_d(plane, m + co * ld, m_step, s.th, s.tw, gn,
                                b[co] if b != NULL else 0)
        for n in range(gn):
            for oh in range(g.Ho):
                dst = y + n * image + (co * g.Ho + oh) * g.Wo
                for ow in range(g.Wo):
                    dst[ow] = plane[(oh * 2 * s.tw + ow) * gn + n]


cdef void _chunk_output_grad(floating* dm, Py_ssize_t ld, const floating* dy, const WinogradPlan* s,
                             Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                             floating* plane) noexcept nogil:
    """dm (16, C_out, ld) = A dy A^T for the tiles of images dy[0:gn], tile rows [ty0, ty1)."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t m_step = _position_stride(g.Co, ld)
    cdef Py_ssize_t co, n, oh, ow, image = g.Co * g.Ho * g.Wo
    cdef floating* dst
    if not s.lanes:
        for n in range(gn):
            _output_grad_tiles(dm + n * (ty1 - ty0) * s.tw, ld, dy + n * image, s, ty0, ty1,
                               band)
        return
    for co in range(g.Co):
        memset(plane, 0, 4 * s.th * s.tw * gn * sizeof(floating))
        for n in range(gn):
            for oh in range(g.Ho):
                dst = plane + oh * 2 * s.tw * gn + n
                for ow in range(g.Wo):
                    dst[ow * gn] = dy[n * image + (co * g.Ho + oh) * g.Wo + ow]
        if floating is float:
            wino_lanes_output_grad_f(dm + co * ld, m_step, plane, s.th, s.tw, gn)
        else:
            wino_lanes_output_grad_d(dm + co * ld, m_step, plane, s.th, s.tw, gn)


cdef void _chunk_input_grad(floating* dx, const floating* dv, Py_ssize_t ld, const WinogradPlan* s,
                            Py_ssize_t gn, Py_ssize_t ty0, Py_ssize_t ty1, floating* band,
                            floating* plane) noexcept nogil:
    """dx[0:gn] (C, H, W) += B dv B^T of the chunk's tiles (tile rows [ty0, ty1))."""
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t v_step = _position_stride(g.C, ld)
    cdef Py_ssize_t c, n, r, q, image = g.C * g.H * g.W
    cdef floating* dst
    if not s.lanes:
        for n in range(gn):
            _input_grad_tiles(dx + n * image, dv + n * (ty1 - ty0) * s.tw, ld, s, ty0, ty1,
                              band)
        return
    for c in range(g.C):
        memset(plane, 0, (2 * s.th + 2) * s.Wp * gn * sizeof(floating))
        if floating is float:
            wino_lanes_input_grad_f(plane, s.Wp, dv + c * ld, v_step, s.th, s.tw, gn)
        else:
            wino_lanes_input_grad_d(plane, s.Wp, dv + c * ld, v_step, s.th, s.tw, gn)
        for n in range(gn):
            for r in range(g.H):
                dst = dx + n * image + (c * g.H + r) * g.W
                for q in range(g.W):
                    dst[q] += plane[((r + g.ph) * s.Wp + g.pw + q) * gn + n]


cdef inline Py_ssize_t _chunk_tiles(const WinogradPlan* s, Py_ssize_t gn, Py_ssize_t ty0,
                                    Py_ssize_t ty1) noexcept nogil:
    return gn * (ty1 - ty0) * s.tw


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   const void* plan, floating* work) noexcept nogil:
    cdef const WinogradPlan* s = <const WinogradPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t groups = (g.N + s.G - 1) // s.G
    cdef Py_ssize_t grp, n0, gn, ty0, ty1, ld, xi, v_step, m_step
    cdef floating* u = work
    cdef floating* v = NULL
    cdef floating* m = NULL
    cdef floating* band = NULL
    cdef floating* plane = NULL
    cdef bint panels = s.panels
    cdef Py_ssize_t u_stride = _u_stride(s, False)
    cdef Weights a
    _transform_weights(u, w, s, False)
    with parallel(num_threads=s.threads):
        v = work + s.u_size + threadid() * s.per_thread
        m = v + 16 * _position_stride(g.C, s.T)
        band = m + 16 * _position_stride(g.Co, s.T)
        plane = band + (12 + 4 * s.R) * (2 * s.tw + 2)
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= g.N else g.N - n0
            ty0 = 0
            while ty0 < s.th:
                ty1 = ty0 + s.R if ty0 + s.R < s.th else s.th
                ld = _chunk_tiles(s, gn, ty0, ty1)
                v_step = _position_stride(g.C, ld)
                m_step = _position_stride(g.Co, ld)
                _chunk_input(v, ld, x + n0 * g.C * g.H * g.W, s, gn, ty0, ty1, band, plane)
                for xi in range(16):
                    a = weights_operand(g.Co, g.C, False, u + xi * u_stride if panels else NULL,
                                        s.panels, s.bf16)
                    times_weights(m + xi * m_step, ld, &a, u + xi * u_stride,
                                  v + xi * v_step, ld, ld, NULL)
                _chunk_output(y + n0 * g.Co * g.Ho * g.Wo, m, ld, b, s, gn, ty0, ty1, band,
                              plane)
                ty0 = ty1


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w, const void* plan,
                    floating* work) noexcept nogil:
    cdef const WinogradPlan* s = <const WinogradPlan*> plan
    cdef const ConvGeometry* g = &s.g
    cdef Py_ssize_t groups = (g.N + s.G - 1) // s.G
    cdef int threads = s.threads
    cdef Py_ssize_t slot = 16 * g.Co * g.C
    cdef floating* u = work
    cdef floating* partials = work + s.u_size
    cdef Py_ssize_t grp, n0, gn, ty0, ty1, ld, xi, v_step, m_step, co, b, block
    cdef floating* v = NULL
    cdef floating* dm = NULL
    cdef floating* du = NULL
    cdef floating* band = NULL
    cdef floating* plane = NULL
    cdef floating* packed = NULL
    cdef floating beta
    cdef bint panels = s.panels
    cdef Py_ssize_t u_stride = _u_stride(s, True)
    cdef Weights a
    # started[t]: 1 once thread t wrote its partial sum. Its first chunk overwrites the
    # partial (no zeroing pass over threads x 16 x C_out x C_in), later chunks add.
    cdef floating* started = partials + threads * slot
    memset(started, 0, threads * sizeof(floating))
    _transform_weights(u, w, s, True)
    with parallel(num_threads=threads):
        v = partials + s.partials_size + threadid() * s.per_thread
        dm = v + 16 * _position_stride(g.C, s.T)
        band = dm + 16 * _position_stride(g.Co, s.T)
        plane = band + (12 + 4 * s.R) * (2 * s.tw + 2)
        packed = plane + s.lane_plane
        du = partials + threadid() * slot
        for grp in prange(groups, schedule="static"):
            n0 = grp * s.G
            gn = s.G if n0 + s.G <= g.N else g.N - n0
            if dx != NULL:
                memset(dx + n0 * g.C * g.H * g.W, 0, gn * g.C * g.H * g.W * sizeof(floating))
            ty0 = 0
            while ty0 < s.th:
                ty1 = ty0 + s.R if ty0 + s.R < s.th else s.th
                ld = _chunk_tiles(s, gn, ty0, ty1)
                v_step = _position_stride(g.C, ld)
                m_step = _position_stride(g.Co, ld)
                _chunk_input(v, ld, x + n0 * g.C * g.H * g.W, s, gn, ty0, ty1, band, plane)
                _chunk_output_grad(dm, ld, dy + n0 * g.Co * g.Ho * g.Wo, s, gn, ty0, ty1, band,
                                   plane)
                beta = started[threadid()]
                started[threadid()] = 1
                for xi in range(16):
                    if floating is float and s.bf16:
                        bf16_gemm_nt(s.bf16, du + xi * g.Co * g.C, g.C,
                                     dm + xi * m_step, ld, g.Co, v + xi * v_step, ld,
                                     g.C, ld, <uint16_t*> packed, s.panels, beta != 0)
                    else:
                        gemm(False, True, <int> g.Co, <int> g.C, <int> ld, <floating> 1,
                             dm + xi * m_step, <int> ld, v + xi * v_step, <int> ld,
                             beta, du + xi * g.Co * g.C, <int> g.C)
                    if dx != NULL:
                        # dV overwrites V: this position's weight-gradient GEMM consumed it.
                        a = weights_operand(g.Co, g.C, True,
                                            u + xi * u_stride if panels else NULL, s.panels,
                                            s.bf16)
                        times_weights(v + xi * v_step, ld, &a, u + xi * u_stride,
                                      dm + xi * m_step, ld, ld, NULL)
                if dx != NULL:
                    _chunk_input_grad(dx + n0 * g.C * g.H * g.W, v, ld, s, gn, ty0, ty1, band,
                                      plane)
                ty0 = ty1
    # dw += G^T (sum of the threads' partials, in thread order) G, parallel over C_out.
    for co in prange(g.Co, schedule="static", num_threads=threads, nogil=True):
        if floating is float:
            wino_weight_grads_f(dw + co * g.C * 9, partials + co * g.C, slot, g.Co * g.C,
                                threads, g.C)
        else:
            wino_weight_grads_d(dw + co * g.C * 9, partials + co * g.C, slot, g.Co * g.C,
                                threads, g.C)
    if db != NULL:
        block = channel_block(g.Co, g.Ho * g.Wo, threads)
        for b in prange((g.Co + block - 1) // block, schedule="static", num_threads=threads,
                        nogil=True):
            _add_bias_gradient(db, dy, b * block, min(b * block + block, g.Co), g.N, g.Co,
                               g.Ho * g.Wo)


cdef inline void _add_bias_gradient(floating* db, const floating* dy, Py_ssize_t c0,
                                    Py_ssize_t c1, Py_ssize_t N, Py_ssize_t C,
                                    Py_ssize_t HW) noexcept nogil:
    """db[c] += the sum of dy's channel c, for the block c0 <= c < c1."""
    cdef double sums[MAX_BLOCK]
    cdef Py_ssize_t c
    channel_sums(sums, dy, c0, c1, N, C, HW)
    for c in range(c0, c1):
        db[c] += <floating> sums[c - c0]


cdef bint _supports(const ConvGeometry* g) noexcept:
    return g.kh == 3 and g.kw == 3 and g.sh == 1 and g.sw == 1


cdef ConvAlgorithm _WINOGRAD = ConvAlgorithm(
    b"winograd", b"a 3x3 kernel at stride 1", sizeof(WinogradPlan), _supports, _plan,
    _forward[float], _forward[double], _backward[float], _backward[double])
algorithm = conv.Algorithm(algorithm_capsule(&_WINOGRAD))
forward, backward, supports = algorithm.forward, algorithm.backward, algorithm.supports
