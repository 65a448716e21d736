/* Tile kernels of the Winograd F(2x2, 3x3) convolution (pyx/winograd.pyx).
 *
 * A tile's 16 transformed values live in 16 "streams" (position xi at stream pointer +
 * xi * stride). Two families vectorize along different axes:
 *   row kernels   one row of tiles of one image: tile tx covers band columns 2tx .. 2tx+3
 *                 and sits at offset tx of each stream; vectors run across the row.
 *   lane kernels  every tile of a plane for L images at once, the images innermost (a plane
 *                 is stored position-major, L values per position, and tile k's values sit
 *                 at offset k*L + image); vectors run across the images. For small planes,
 *                 whose rows are too short to fill a vector.
 * They are in C for `restrict`: with 16 output streams Cython cannot declare non-aliasing,
 * and the compiler then leaves these loops scalar. One macro, instantiated for float (_f)
 * and double (_d).
 *
 * The transforms (Lavin & Gray's F(2x2, 3x3)), each applied down the columns, then along
 * the rows of a tile:
 *   weights G w G^T,  G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
 *   input   B^T d B,  B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
 *   output  A^T m A,  A^T = [1 1 1 0; 0 1 -1 -1]
 * and, for backward, their adjoints A g A^T and B v B^T, and G^T du G for the weights.
 */
#ifndef DYNAR_WINOGRAD_TILES_H
#define DYNAR_WINOGRAD_TILES_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

/* G g G^T for one 3x3 kernel g (row-major at G_PTR), down the columns (t = G g, rows
 * a b c d), then along each row: STORE, with XI and VALUE defined, for each of the 16 values.
 * In scalars, no arrays, so that a loop over kernels vectorizes. Needs REAL h = 0.5. */
#define WINO_WEIGHT_ROW(REAL, I, X0, X1, X2, STORE)                                          \
    {                                                                                        \
        REAL even_ = h * ((X0) + (X2));                                                      \
        { const int XI = 4 * (I); const REAL VALUE = (X0); STORE; }                          \
        { const int XI = 4 * (I) + 1; const REAL VALUE = even_ + h * (X1); STORE; }          \
        { const int XI = 4 * (I) + 2; const REAL VALUE = even_ - h * (X1); STORE; }          \
        { const int XI = 4 * (I) + 3; const REAL VALUE = (X2); STORE; }                      \
    }
#define WINO_WEIGHT_TILE(REAL, G_PTR, STORE)                                                 \
    {                                                                                        \
        const REAL *g_ = (G_PTR);                                                            \
        REAL e0 = h * (g_[0] + g_[6]), e1 = h * (g_[1] + g_[7]), e2 = h * (g_[2] + g_[8]);   \
        REAL b0 = e0 + h * g_[3], b1 = e1 + h * g_[4], b2 = e2 + h * g_[5];                  \
        REAL c0 = e0 - h * g_[3], c1 = e1 - h * g_[4], c2 = e2 - h * g_[5];                  \
        WINO_WEIGHT_ROW(REAL, 0, g_[0], g_[1], g_[2], STORE)                                 \
        WINO_WEIGHT_ROW(REAL, 1, b0, b1, b2, STORE)                                          \
        WINO_WEIGHT_ROW(REAL, 2, c0, c1, c2, STORE)                                          \
        WINO_WEIGHT_ROW(REAL, 3, g_[6], g_[7], g_[8], STORE)                                 \
    }

/* The weight gradient's 1-D transform G^T (3 from 4): O0..O2 = G^T (U0..U3). Needs h. */
#define WINO_GT(REAL, O0, O1, O2, U0, U1, U2, U3)                                            \
    {                                                                                        \
        REAL half_sum_ = h * ((U1) + (U2));                                                  \
        O0 = (U0) + half_sum_;                                                               \
        O1 = h * ((U1) - (U2));                                                              \
        O2 = half_sum_ + (U3);                                                               \
    }

#define DYNAR_WINOGRAD_TILES(REAL, SUFFIX)                                                   \
/* The weight transform of `count` channel pairs, vectorized across them: pair r's kernel    \
 * g at w + r * w_step, (G g G^T)[xi] at u[xi * stride + r]. */                              \
static inline void wino_weights_##SUFFIX(                                                    \
        REAL *restrict u, ptrdiff_t stride, const REAL *restrict w, ptrdiff_t w_step,        \
        ptrdiff_t count)                                                                     \
{                                                                                            \
    const REAL h = (REAL) 0.5;                                                               \
    _Pragma("omp simd")                                                                      \
    for (ptrdiff_t r = 0; r < count; r++) {                                                  \
        WINO_WEIGHT_TILE(REAL, w + r * w_step, u[(XI) * stride + r] = (VALUE))               \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* dw += G^T du G for `count` channel pairs, vectorized across them: pair r's du[xi] is the  \
 * sum, in thread order, of partials[t * slot + xi * stride + r] (t < threads), gathered    \
 * into thread 0's partials; its 3x3 gradient at dw + 9 r. The same sums in the same order   \
 * for any count: deterministic. */                                                          \
static inline void wino_weight_grads_##SUFFIX(                                               \
        REAL *restrict dw, REAL *restrict partials, ptrdiff_t slot, ptrdiff_t stride,        \
        int threads, ptrdiff_t count)                                                        \
{                                                                                            \
    const REAL h = (REAL) 0.5;                                                               \
    for (int i = 1; i < threads; i++)                                                        \
        for (int xi = 0; xi < 16; xi++) {                                                    \
            REAL *restrict sum = partials + xi * stride;                                     \
            const REAL *restrict part = partials + i * slot + xi * stride;                   \
            _Pragma("omp simd")                                                              \
            for (ptrdiff_t r = 0; r < count; r++)                                            \
                sum[r] += part[r];                                                           \
        }                                                                                    \
    _Pragma("omp simd")                                                                      \
    for (ptrdiff_t r = 0; r < count; r++) {                                                  \
        const REAL *du = partials + r;                                                       \
        REAL t[12], g0, g1, g2;                                                              \
        for (int k = 0; k < 4; k++)    /* down the columns: t (3, 4) = G^T du */             \
            WINO_GT(REAL, t[k], t[4 + k], t[8 + k], du[k * stride], du[(4 + k) * stride],    \
                    du[(8 + k) * stride], du[(12 + k) * stride])                             \
        for (int k = 0; k < 3; k++) {  /* along the rows */                                  \
            WINO_GT(REAL, g0, g1, g2, t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3])    \
            dw[9 * r + 3 * k] += g0;                                                         \
            dw[9 * r + 3 * k + 1] += g1;                                                     \
            dw[9 * r + 3 * k + 2] += g2;                                                     \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The column half of the input transform for one row of tiles: t = B^T d, d the 4 image     \
 * rows d0..d3 (W wide; a row in the padding points at zeros) seen shifted right by pw and   \
 * zero-padded to the band width 2*tw + 2. t: 4 band-wide rows. */                           \
static inline void wino_input_columns_##SUFFIX(                                              \
        REAL *restrict t, const REAL *restrict d0, const REAL *restrict d1,                  \
        const REAL *restrict d2, const REAL *restrict d3, ptrdiff_t W,                       \
        ptrdiff_t pw, ptrdiff_t tw)                                                          \
{                                                                                            \
    const ptrdiff_t width = 2 * tw + 2;                                                      \
    const ptrdiff_t n = W < width - pw ? W : width - pw;                                     \
    REAL *t0 = t, *t1 = t + width, *t2 = t + 2 * width, *t3 = t + 3 * width;                 \
    for (ptrdiff_t k = 0; k < pw; k++)                                                       \
        t0[k] = t1[k] = t2[k] = t3[k] = 0;                                                   \
    _Pragma("omp simd")                                                                      \
    for (ptrdiff_t k = 0; k < n; k++) {                                                      \
        t0[pw + k] = d0[k] - d2[k];                                                          \
        t1[pw + k] = d1[k] + d2[k];                                                          \
        t2[pw + k] = d2[k] - d1[k];                                                          \
        t3[pw + k] = d1[k] - d3[k];                                                          \
    }                                                                                        \
    for (ptrdiff_t k = pw + n; k < width; k++)                                               \
        t0[k] = t1[k] = t2[k] = t3[k] = 0;                                                   \
}                                                                                            \
                                                                                             \
/* The row half: v[xi] for a row of tw tiles = t B, t from wino_input_columns. Run it on     \
 * t well after t was written: read back at once, the shifted stores stall store             \
 * forwarding. */                                                                            \
static inline void wino_input_row_##SUFFIX(                                                  \
        REAL *restrict v, ptrdiff_t stride, const REAL *restrict t, ptrdiff_t tw)            \
{                                                                                            \
    const ptrdiff_t width = 2 * tw + 2;                                                      \
    for (int i = 0; i < 4; i++) {                                                            \
        const REAL *r = t + i * width;                                                       \
        REAL *o0 = v + (4 * i) * stride, *o1 = o0 + stride, *o2 = o1 + stride,               \
             *o3 = o2 + stride;                                                              \
        _Pragma("omp simd")                                                                  \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            REAL a = r[2 * tx], b = r[2 * tx + 1], c = r[2 * tx + 2], e = r[2 * tx + 3];     \
            o0[tx] = a - c;                                                                  \
            o1[tx] = b + c;                                                                  \
            o2[tx] = c - b;                                                                  \
            o3[tx] = b - e;                                                                  \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The two output rows (each 2*tw wide) of a row of tiles = A^T m A + bias. */               \
static inline void wino_output_row_##SUFFIX(                                                 \
        REAL *restrict y0, REAL *restrict y1, const REAL *restrict m,                        \
        ptrdiff_t stride, ptrdiff_t tw, REAL bias)                                           \
{                                                                                            \
    const REAL *m0 = m, *m1 = m + stride, *m2 = m + 2 * stride, *m3 = m + 3 * stride,        \
        *m4 = m + 4 * stride, *m5 = m + 5 * stride, *m6 = m + 6 * stride,                    \
        *m7 = m + 7 * stride, *m8 = m + 8 * stride, *m9 = m + 9 * stride,                    \
        *m10 = m + 10 * stride, *m11 = m + 11 * stride, *m12 = m + 12 * stride,              \
        *m13 = m + 13 * stride, *m14 = m + 14 * stride, *m15 = m + 15 * stride;              \
    _Pragma("omp simd")                                                                      \
    for (ptrdiff_t tx = 0; tx < tw; tx++) {                                                  \
        /* t = A^T m (2 x 4), then each row of t times A */                                  \
        REAL t0 = m0[tx] + m4[tx] + m8[tx], t1 = m1[tx] + m5[tx] + m9[tx],                   \
             t2 = m2[tx] + m6[tx] + m10[tx], t3 = m3[tx] + m7[tx] + m11[tx];                 \
        REAL u0 = m4[tx] - m8[tx] - m12[tx], u1 = m5[tx] - m9[tx] - m13[tx],                 \
             u2 = m6[tx] - m10[tx] - m14[tx], u3 = m7[tx] - m11[tx] - m15[tx];               \
        y0[2 * tx] = t0 + t1 + t2 + bias;                                                    \
        y0[2 * tx + 1] = t1 - t2 - t3 + bias;                                                \
        y1[2 * tx] = u0 + u1 + u2 + bias;                                                    \
        y1[2 * tx + 1] = u1 - u2 - u3 + bias;                                                \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* dm[xi] for a row of tiles = A g A^T, g the 2x2 output gradients in rows g0, g1            \
 * (each >= 2*tw wide). */                                                                   \
static inline void wino_output_grad_row_##SUFFIX(                                            \
        REAL *restrict dm, ptrdiff_t stride, const REAL *restrict g0,                        \
        const REAL *restrict g1, ptrdiff_t tw)                                               \
{                                                                                            \
    REAL *o0 = dm, *o1 = dm + stride, *o2 = dm + 2 * stride, *o3 = dm + 3 * stride,          \
        *o4 = dm + 4 * stride, *o5 = dm + 5 * stride, *o6 = dm + 6 * stride,                 \
        *o7 = dm + 7 * stride, *o8 = dm + 8 * stride, *o9 = dm + 9 * stride,                 \
        *o10 = dm + 10 * stride, *o11 = dm + 11 * stride, *o12 = dm + 12 * stride,           \
        *o13 = dm + 13 * stride, *o14 = dm + 14 * stride, *o15 = dm + 15 * stride;           \
    _Pragma("omp simd")                                                                      \
    for (ptrdiff_t tx = 0; tx < tw; tx++) {                                                  \
        REAL a = g0[2 * tx], b = g0[2 * tx + 1], c = g1[2 * tx], e = g1[2 * tx + 1];         \
        /* t = A g (4 x 2): rows g0, g0 + g1, g0 - g1, -g1; then each row of t times A^T */  \
        REAL s0 = a + c, s1 = b + e, d0 = a - c, d1 = b - e;                                 \
        o0[tx] = a;   o1[tx] = a + b;    o2[tx] = a - b;    o3[tx] = -b;                     \
        o4[tx] = s0;  o5[tx] = s0 + s1;  o6[tx] = s0 - s1;  o7[tx] = -s1;                    \
        o8[tx] = d0;  o9[tx] = d0 + d1;  o10[tx] = d0 - d1; o11[tx] = -d1;                   \
        o12[tx] = -c; o13[tx] = -c - e;  o14[tx] = e - c;   o15[tx] = e;                     \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The 4 band rows (each 2*tw + 2 wide) a row of tiles read = sum over its tiles of          \
 * B dv B^T, added where each tile's patch was read (tiles overlap by two columns).          \
 * t: scratch of 16 * tw. */                                                                 \
static inline void wino_input_grad_row_##SUFFIX(                                             \
        REAL *restrict band, ptrdiff_t width, const REAL *restrict dv,                       \
        ptrdiff_t stride, ptrdiff_t tw, REAL *restrict t)                                    \
{                                                                                            \
    /* down the columns: t = B dv, column j of each tile */                                  \
    for (int j = 0; j < 4; j++) {                                                            \
        const REAL *v0 = dv + j * stride, *v1 = dv + (4 + j) * stride,                       \
            *v2 = dv + (8 + j) * stride, *v3 = dv + (12 + j) * stride;                       \
        REAL *t0 = t + j * tw, *t1 = t + (4 + j) * tw, *t2 = t + (8 + j) * tw,               \
            *t3 = t + (12 + j) * tw;                                                         \
        _Pragma("omp simd")                                                                  \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            t0[tx] = v0[tx];                                                                 \
            t1[tx] = v1[tx] - v2[tx] + v3[tx];                                               \
            t2[tx] = v1[tx] + v2[tx] - v0[tx];                                               \
            t3[tx] = -v3[tx];                                                                \
        }                                                                                    \
    }                                                                                        \
    /* along the rows: row i of t times B^T */                                               \
    for (int i = 0; i < 4; i++) {                                                            \
        REAL *row = band + i * width;                                                        \
        const REAL *c0 = t + 4 * i * tw, *c1 = c0 + tw, *c2 = c1 + tw, *c3 = c2 + tw;        \
        /* columns 0, 1 of tile tx land at 2tx, 2tx+1 (no overlap between tiles) ... */      \
        _Pragma("omp simd")                                                                  \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            row[2 * tx] = c0[tx];                                                            \
            row[2 * tx + 1] = c1[tx] - c2[tx] + c3[tx];                                      \
        }                                                                                    \
        row[2 * tw] = 0;                                                                     \
        row[2 * tw + 1] = 0;                                                                 \
        /* ... columns 2, 3 are then added at 2tx+2, 2tx+3 */                                \
        _Pragma("omp simd")                                                                  \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            row[2 * tx + 2] += c1[tx] + c2[tx] - c0[tx];                                     \
            row[2 * tx + 3] -= c3[tx];                                                       \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* ---- lane kernels: tiles of L images at once; plane[pos * L + image] ---- */              \
                                                                                             \
/* v[xi] of every tile of a plane = B^T d B; xt: the input plane padded (zero border of      \
 * ph, pw), Wp positions per row. */                                                         \
static inline void wino_lanes_input_##SUFFIX(                                                \
        REAL *restrict v, ptrdiff_t stride, const REAL *restrict xt, ptrdiff_t Wp,           \
        ptrdiff_t th, ptrdiff_t tw, ptrdiff_t L)                                             \
{                                                                                            \
    const ptrdiff_t row = Wp * L;                                                            \
    for (ptrdiff_t ty = 0; ty < th; ty++)                                                    \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            const REAL *p = xt + (2 * ty * Wp + 2 * tx) * L;                                 \
            REAL *o = v + (ty * tw + tx) * L;                                                \
            _Pragma("omp simd")                                                              \
            for (ptrdiff_t g = 0; g < L; g++) {                                              \
                REAL t[16];                                                                  \
                for (int j = 0; j < 4; j++) {       /* down the columns: t = B^T d */        \
                    REAL d0 = p[j * L + g], d1 = p[row + j * L + g],                         \
                         d2 = p[2 * row + j * L + g], d3 = p[3 * row + j * L + g];           \
                    t[j] = d0 - d2;                                                          \
                    t[4 + j] = d1 + d2;                                                      \
                    t[8 + j] = d2 - d1;                                                      \
                    t[12 + j] = d1 - d3;                                                     \
                }                                                                            \
                for (int i = 0; i < 4; i++) {       /* along the rows: v = t B */            \
                    o[(4 * i) * stride + g] = t[4 * i] - t[4 * i + 2];                       \
                    o[(4 * i + 1) * stride + g] = t[4 * i + 1] + t[4 * i + 2];               \
                    o[(4 * i + 2) * stride + g] = t[4 * i + 2] - t[4 * i + 1];               \
                    o[(4 * i + 3) * stride + g] = t[4 * i + 1] - t[4 * i + 3];               \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
}                                                                                            \
                                                                                             \
/* yt (2*th x 2*tw positions) = A^T m A + bias for every tile of a plane. */                 \
static inline void wino_lanes_output_##SUFFIX(                                               \
        REAL *restrict yt, const REAL *restrict m, ptrdiff_t stride, ptrdiff_t th,           \
        ptrdiff_t tw, ptrdiff_t L, REAL bias)                                                \
{                                                                                            \
    const ptrdiff_t row = 2 * tw * L;                                                        \
    for (ptrdiff_t ty = 0; ty < th; ty++)                                                    \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            const REAL *mt = m + (ty * tw + tx) * L;                                         \
            REAL *q = yt + (2 * ty * 2 * tw + 2 * tx) * L;                                   \
            _Pragma("omp simd")                                                              \
            for (ptrdiff_t g = 0; g < L; g++) {                                              \
                REAL t[4], u[4];                /* t, u: the rows of A^T m */                \
                for (int j = 0; j < 4; j++) {                                                \
                    REAL m0 = mt[j * stride + g], m1 = mt[(4 + j) * stride + g],             \
                         m2 = mt[(8 + j) * stride + g], m3 = mt[(12 + j) * stride + g];      \
                    t[j] = m0 + m1 + m2;                                                     \
                    u[j] = m1 - m2 - m3;                                                     \
                }                                                                            \
                q[g] = t[0] + t[1] + t[2] + bias;                                            \
                q[L + g] = t[1] - t[2] - t[3] + bias;                                        \
                q[row + g] = u[0] + u[1] + u[2] + bias;                                      \
                q[row + L + g] = u[1] - u[2] - u[3] + bias;                                  \
            }                                                                                \
        }                                                                                    \
}                                                                                            \
                                                                                             \
/* dm[xi] of every tile of a plane = A g A^T; dyt: the output gradient plane (2*th x 2*tw    \
 * positions, zero past an odd edge). */                                                     \
static inline void wino_lanes_output_grad_##SUFFIX(                                          \
        REAL *restrict dm, ptrdiff_t stride, const REAL *restrict dyt, ptrdiff_t th,         \
        ptrdiff_t tw, ptrdiff_t L)                                                           \
{                                                                                            \
    const ptrdiff_t row = 2 * tw * L;                                                        \
    for (ptrdiff_t ty = 0; ty < th; ty++)                                                    \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            const REAL *q = dyt + (2 * ty * 2 * tw + 2 * tx) * L;                            \
            REAL *o = dm + (ty * tw + tx) * L;                                               \
            _Pragma("omp simd")                                                              \
            for (ptrdiff_t g = 0; g < L; g++) {                                              \
                REAL a = q[g], b = q[L + g], c = q[row + g], e = q[row + L + g];             \
                REAL s0 = a + c, s1 = b + e, d0 = a - c, d1 = b - e;                         \
                o[g] = a;                   o[stride + g] = a + b;                           \
                o[2 * stride + g] = a - b;  o[3 * stride + g] = -b;                          \
                o[4 * stride + g] = s0;     o[5 * stride + g] = s0 + s1;                     \
                o[6 * stride + g] = s0 - s1; o[7 * stride + g] = -s1;                        \
                o[8 * stride + g] = d0;     o[9 * stride + g] = d0 + d1;                     \
                o[10 * stride + g] = d0 - d1; o[11 * stride + g] = -d1;                      \
                o[12 * stride + g] = -c;    o[13 * stride + g] = -c - e;                     \
                o[14 * stride + g] = e - c; o[15 * stride + g] = e;                          \
            }                                                                                \
        }                                                                                    \
}                                                                                            \
                                                                                             \
/* dxt (the padded input plane, Wp positions per row; zeroed by the caller) += B dv B^T of   \
 * every tile of a plane, each added where its patch was read. */                            \
static inline void wino_lanes_input_grad_##SUFFIX(                                           \
        REAL *restrict dxt, ptrdiff_t Wp, const REAL *restrict dv, ptrdiff_t stride,         \
        ptrdiff_t th, ptrdiff_t tw, ptrdiff_t L)                                             \
{                                                                                            \
    for (ptrdiff_t ty = 0; ty < th; ty++)                                                    \
        for (ptrdiff_t tx = 0; tx < tw; tx++) {                                              \
            const REAL *vt = dv + (ty * tw + tx) * L;                                        \
            REAL *q = dxt + (2 * ty * Wp + 2 * tx) * L;                                      \
            _Pragma("omp simd")                                                              \
            for (ptrdiff_t g = 0; g < L; g++) {                                              \
                REAL t[16];                                                                  \
                for (int j = 0; j < 4; j++) {       /* down the columns: t = B dv */         \
                    REAL v0 = vt[j * stride + g], v1 = vt[(4 + j) * stride + g],             \
                         v2 = vt[(8 + j) * stride + g], v3 = vt[(12 + j) * stride + g];      \
                    t[j] = v0;                                                               \
                    t[4 + j] = v1 - v2 + v3;                                                 \
                    t[8 + j] = v1 + v2 - v0;                                                 \
                    t[12 + j] = -v3;                                                         \
                }                                                                            \
                for (int i = 0; i < 4; i++) {       /* along the rows: t B^T */              \
                    REAL *r = q + i * Wp * L;                                                \
                    r[g] += t[4 * i];                                                        \
                    r[L + g] += t[4 * i + 1] - t[4 * i + 2] + t[4 * i + 3];                  \
                    r[2 * L + g] += t[4 * i + 1] + t[4 * i + 2] - t[4 * i];                  \
                    r[3 * L + g] -= t[4 * i + 3];                                            \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
}

DYNAR_WINOGRAD_TILES(float, f)
DYNAR_WINOGRAD_TILES(double, d)
#undef DYNAR_WINOGRAD_TILES

/* wino_weights_f rounded to bf16 as include/bf16.h rounds. Called along a bf16 panel's
 * depth, where a row's halves are adjacent within a block (include/panel_gemm_bf16.h): the
 * stores fill whole cache lines, which across its rows (2-byte stores 64 bytes apart) they
 * did not. */
static inline void wino_weights_bf16(uint16_t *restrict u, ptrdiff_t stride,
                                     const float *restrict w, ptrdiff_t w_step, ptrdiff_t count)
{
    const float h = 0.5f;
    _Pragma("omp simd")
    for (ptrdiff_t r = 0; r < count; r++) {
        WINO_WEIGHT_TILE(float, w + r * w_step,
                         u[(XI) * stride + r] = dynar_bf16_from_float(VALUE))
    }
}

#undef WINO_GT
#undef WINO_WEIGHT_TILE
#undef WINO_WEIGHT_ROW
#endif
