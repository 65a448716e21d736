/* The tap loops of the direct convolution (pyx/direct.pyx), for layers with few channels.
 *
 * Every plane is stored at the padded row width Wp and read flat: output position
 * q = oh * Wp + ow takes tap (i, j) from input position q + i * Wp + j, so a tap is one
 * contiguous run and the loops below are long vector loops whatever the image width.
 * Positions with ow >= Wo are computed too and dropped by the caller.
 *
 * Register blocks hold up to 24 vectors of accumulators: in the correlation each loaded
 * input vector feeds one multiply-add per output channel of the block (up to 6); in the
 * weight gradient each loaded vector of the output gradient feeds one per tap of a run of
 * up to 5 neighbouring taps, and each input vector one per channel (up to 4). Block sizes
 * are compile-time constants in every call (the DIRECT_CONST dispatch), so the
 * accumulators stay in registers and short blocks waste nothing. Vector types (GCC and
 * Clang extensions) pin the vectorization down: left to itself GCC vectorized the weight
 * gradient across channels, with gathers. */
#ifndef DYNAR_DIRECT_TAPS_H
#define DYNAR_DIRECT_TAPS_H
#include <stddef.h>

/* DIRECT_LANES floats make one vector register. Register blocks, at most: output channels x
 * vectors of positions in the correlation (CB x NV), output channels x taps in the weight
 * gradient (GB x JB); with the vectors they load, 29 and 26 registers where there are 32
 * (x86-64 with AVX-512, aarch64), 13 where there are 16. */
#if defined(__AVX512F__)
#define DIRECT_LANES 16
#elif defined(__AVX__)
#define DIRECT_LANES 8
#else
#define DIRECT_LANES 4
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define DIRECT_CB 6
#define DIRECT_NV 4
#define DIRECT_GB 4
#define DIRECT_JB 5
#else
#define DIRECT_CB 3
#define DIRECT_NV 3
#define DIRECT_GB 3
#define DIRECT_JB 3
#endif

/* Up to how many channel pairs (C_in * C_out) nn.Conv2d prefers these kernels
 * (dynar/nn/conv_algorithms.py). The BLAS behind im2col picks its kernels for the CPU at run
 * time; these are as wide as the build's flags allow, so the bound is the build's: by vector
 * width, measured on a Zen 4 (docs/notes/2026-12-02-kernels.md, "Where each algorithm wins");
 * aarch64 takes the AVX2 bound until measured on hardware. */
#if defined(__AVX512F__)
#define DIRECT_PREFERRED_MAX_PAIRS 1024
#elif defined(__AVX2__) || defined(__aarch64__)
#define DIRECT_PREFERRED_MAX_PAIRS 256
#else
#define DIRECT_PREFERRED_MAX_PAIRS 0
#endif
#define DIRECT_QB (DIRECT_NV * DIRECT_LANES)    /* positions per correlation block */

#define DIRECT_INLINE static inline __attribute__((always_inline))

/* Makes the compiler hold a float vector in a register. Without it GCC re-reads a vector it
 * uses 4 times as the memory operand of each multiply-add, and on cores that load one
 * 512-bit vector a cycle (AMD Zen 4) the loads, not the multiply-adds, set the pace. (The
 * double kernels, for gradient checks, have vectors wider than a register.) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define DIRECT_IN_REGISTER_f(v) __asm__("" : "+v"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define DIRECT_IN_REGISTER_f(v) __asm__("" : "+w"(v))
#else
#define DIRECT_IN_REGISTER_f(v) ((void)0)
#endif
#define DIRECT_IN_REGISTER_d(v) ((void)0)

/* F(args..., n) with n, which is at most max (a constant, at most 6), as a constant: each
 * case compiles to its own specialization; cases past max are never taken and compile
 * as max. */
#define DIRECT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define DIRECT_CONST(max, n, F, ...)                                                         \
    do {                                                                                    \
        switch (n) {                                                                        \
        case 6: F(__VA_ARGS__, DIRECT_MIN(6, max)); break;                                  \
        case 5: F(__VA_ARGS__, DIRECT_MIN(5, max)); break;                                  \
        case 4: F(__VA_ARGS__, DIRECT_MIN(4, max)); break;                                  \
        case 3: F(__VA_ARGS__, DIRECT_MIN(3, max)); break;                                  \
        case 2: F(__VA_ARGS__, 2); break;                                                   \
        default: F(__VA_ARGS__, 1); break;                                                  \
        }                                                                                   \
    } while (0)

#define DYNAR_DIRECT_TAPS(REAL, SUFFIX)                                                      \
/* vectors in registers, and the same at any address in memory */                          \
typedef REAL direct_vec_##SUFFIX __attribute__((vector_size(DIRECT_LANES * sizeof(REAL))));  \
typedef REAL direct_mem_##SUFFIX                                                            \
    __attribute__((vector_size(DIRECT_LANES * sizeof(REAL)), aligned(sizeof(REAL))));       \
                                                                                            \
/* cb channels from co0 x nv vectors from q0 of the correlation below. */                   \
DIRECT_INLINE void direct_correlate_block_##SUFFIX(                                         \
    REAL *restrict out, ptrdiff_t out_ld, const REAL *restrict in, ptrdiff_t plane,         \
    ptrdiff_t Wp, const REAL *restrict w, const REAL *restrict bias, ptrdiff_t C,           \
    ptrdiff_t kh, ptrdiff_t kw, ptrdiff_t co0, ptrdiff_t q0, int cb, int nv)                \
{                                                                                           \
    typedef direct_vec_##SUFFIX vec;                                                        \
    typedef direct_mem_##SUFFIX mem;                                                        \
    const ptrdiff_t taps = C * kh * kw;                                                     \
    vec acc[DIRECT_CB][DIRECT_NV];                                                          \
    for (int b = 0; b < cb; b++)                                                            \
        for (int v = 0; v < nv; v++)                                                        \
            acc[b][v] = (vec){0} + (bias ? bias[co0 + b] : (REAL)0);                        \
    for (ptrdiff_t c = 0; c < C; c++)                                                       \
        for (ptrdiff_t i = 0; i < kh; i++)                                                  \
            for (ptrdiff_t j = 0; j < kw; j++) {                                            \
                const REAL *xs = in + c * plane + i * Wp + j + q0;                          \
                const REAL *wt = w + co0 * taps + (c * kh + i) * kw + j;                    \
                vec xv[DIRECT_NV];                                                          \
                for (int v = 0; v < nv; v++) {                                              \
                    xv[v] = *(const mem *)(xs + v * DIRECT_LANES);                          \
                    DIRECT_IN_REGISTER_##SUFFIX(xv[v]);                                      \
                }                                                                           \
                for (int b = 0; b < cb; b++)                                                \
                    for (int v = 0; v < nv; v++)                                            \
                        acc[b][v] += wt[b * taps] * xv[v];                                  \
            }                                                                               \
    for (int b = 0; b < cb; b++)                                                            \
        for (int v = 0; v < nv; v++)                                                        \
            *(mem *)(out + (co0 + b) * out_ld + q0 + v * DIRECT_LANES) = acc[b][v];         \
}                                                                                           \
                                                                                            \
DIRECT_INLINE void direct_correlate_cb_##SUFFIX(                                            \
    REAL *restrict out, ptrdiff_t out_ld, const REAL *restrict in, ptrdiff_t plane,         \
    ptrdiff_t Wp, const REAL *restrict w, const REAL *restrict bias, ptrdiff_t C,           \
    ptrdiff_t kh, ptrdiff_t kw, ptrdiff_t co0, ptrdiff_t npos, int cb)                      \
{                                                                                           \
    ptrdiff_t q0 = 0;                                                                       \
    for (; q0 + DIRECT_QB <= npos; q0 += DIRECT_QB)                                         \
        direct_correlate_block_##SUFFIX(out, out_ld, in, plane, Wp, w, bias, C, kh, kw,     \
                                        co0, q0, cb, DIRECT_NV);                            \
    if (q0 < npos)                                                                          \
        DIRECT_CONST(DIRECT_NV - 1, (npos - q0) / DIRECT_LANES,                             \
                     direct_correlate_block_##SUFFIX, out, out_ld, in, plane, Wp, w, bias,  \
                     C, kh, kw, co0, q0, cb);                                               \
}                                                                                           \
                                                                                            \
/* out[co * out_ld + q] = bias[co] (0 without bias)                                       \
 *     + the sum over c, i, j of w[co][c][i][j] * in[c * plane + i * Wp + j + q],          \
 * for co < Co and q < npos, a multiple of DIRECT_LANES. w: (Co, C, kh, kw). */            \
static void direct_correlate_##SUFFIX(REAL *restrict out, ptrdiff_t out_ld,                 \
                                      const REAL *restrict in, ptrdiff_t plane,             \
                                      ptrdiff_t Wp, const REAL *restrict w,                 \
                                      const REAL *restrict bias, ptrdiff_t Co,              \
                                      ptrdiff_t C, ptrdiff_t kh, ptrdiff_t kw,              \
                                      ptrdiff_t npos)                                       \
{                                                                                           \
    for (ptrdiff_t co0 = 0; co0 < Co; co0 += DIRECT_CB) {                                   \
        const ptrdiff_t cb = Co - co0 < DIRECT_CB ? Co - co0 : DIRECT_CB;                   \
        DIRECT_CONST(DIRECT_CB, cb, direct_correlate_cb_##SUFFIX, out, out_ld, in, plane,   \
                     Wp, w, bias, C, kh, kw, co0, npos);                                    \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* gb channels from co0 x jb taps from t (one kernel row, input xs) of the weight          \
 * gradient below. */                                                                       \
DIRECT_INLINE void direct_weight_grad_block_##SUFFIX(                                       \
    REAL *restrict lanes, const REAL *restrict g, ptrdiff_t g_ld, const REAL *restrict xs,  \
    ptrdiff_t taps, ptrdiff_t npos, ptrdiff_t co0, ptrdiff_t t, int gb, int jb)             \
{                                                                                           \
    typedef direct_vec_##SUFFIX vec;                                                        \
    typedef direct_mem_##SUFFIX mem;                                                        \
    vec acc[DIRECT_GB][DIRECT_JB];                                                          \
    for (int b = 0; b < gb; b++)                                                            \
        for (int j = 0; j < jb; j++)                                                        \
            acc[b][j] = (vec){0};                                                           \
    for (ptrdiff_t q0 = 0; q0 < npos; q0 += DIRECT_LANES) {                                 \
        vec xv[DIRECT_JB];                                                                  \
        for (int j = 0; j < jb; j++) {                                                      \
            xv[j] = *(const mem *)(xs + j + q0);                                            \
            DIRECT_IN_REGISTER_##SUFFIX(xv[j]);                                              \
        }                                                                                   \
        for (int b = 0; b < gb; b++) {                                                      \
            vec gv = *(const mem *)(g + (co0 + b) * g_ld + q0);                             \
            DIRECT_IN_REGISTER_##SUFFIX(gv);                                                 \
            for (int j = 0; j < jb; j++)                                                    \
                acc[b][j] += gv * xv[j];                                                    \
        }                                                                                   \
    }                                                                                       \
    for (int b = 0; b < gb; b++)                                                            \
        for (int j = 0; j < jb; j++)                                                        \
            *(mem *)(lanes + ((co0 + b) * taps + t + j) * DIRECT_LANES) += acc[b][j];       \
}                                                                                           \
                                                                                            \
DIRECT_INLINE void direct_weight_grad_gb_##SUFFIX(                                          \
    REAL *restrict lanes, const REAL *restrict g, ptrdiff_t g_ld, const REAL *restrict xs,  \
    ptrdiff_t taps, ptrdiff_t npos, ptrdiff_t co0, ptrdiff_t t, ptrdiff_t kw, int gb)       \
{                                                                                           \
    ptrdiff_t j = 0;                                                                        \
    for (; j + DIRECT_JB <= kw; j += DIRECT_JB)                                             \
        direct_weight_grad_block_##SUFFIX(lanes, g, g_ld, xs + j, taps, npos, co0, t + j,   \
                                          gb, DIRECT_JB);                                   \
    if (j < kw)                                                                             \
        DIRECT_CONST(DIRECT_JB - 1, kw - j, direct_weight_grad_block_##SUFFIX, lanes, g,    \
                     g_ld, xs + j, taps, npos, co0, t + j, gb);                             \
}                                                                                           \
                                                                                            \
/* lanes[(co * C * kh * kw + t) * DIRECT_LANES + l], t = (c * kh + i) * kw + j, += the sum  \
 * over q < npos with q % DIRECT_LANES == l of g[co * g_ld + q] * in[c * plane + i * Wp + j + q];    \
 * npos a multiple of DIRECT_LANES. The caller adds the lanes up at the end. */           \
static void direct_weight_grad_##SUFFIX(REAL *restrict lanes, const REAL *restrict g,       \
                                        ptrdiff_t g_ld, const REAL *restrict in,            \
                                        ptrdiff_t plane, ptrdiff_t Wp, ptrdiff_t Co,        \
                                        ptrdiff_t C, ptrdiff_t kh, ptrdiff_t kw,            \
                                        ptrdiff_t npos)                                     \
{                                                                                           \
    const ptrdiff_t taps = C * kh * kw;                                                     \
    for (ptrdiff_t c = 0; c < C; c++)                                                       \
        for (ptrdiff_t i = 0; i < kh; i++)                                                  \
            for (ptrdiff_t co0 = 0; co0 < Co; co0 += DIRECT_GB) {                           \
                const ptrdiff_t gb = Co - co0 < DIRECT_GB ? Co - co0 : DIRECT_GB;           \
                DIRECT_CONST(DIRECT_GB, gb, direct_weight_grad_gb_##SUFFIX, lanes, g, g_ld, \
                             in + c * plane + i * Wp, taps, npos, co0, (c * kh + i) * kw,   \
                             kw);                                                           \
            }                                                                               \
}                                                                                           \
                                                                                            \
/* lanes[co * DIRECT_LANES + l] += the sum over q < npos with q % DIRECT_LANES == l of     \
 * g[co * g_ld + q]: the bias gradient, npos a multiple of DIRECT_LANES. */                 \
static void direct_bias_grad_##SUFFIX(REAL *restrict lanes, const REAL *restrict g,         \
                                      ptrdiff_t g_ld, ptrdiff_t Co, ptrdiff_t npos)         \
{                                                                                           \
    typedef direct_vec_##SUFFIX vec;                                                        \
    typedef direct_mem_##SUFFIX mem;                                                        \
    for (ptrdiff_t co = 0; co < Co; co++) {                                                 \
        vec acc = {0};                                                                      \
        for (ptrdiff_t q0 = 0; q0 < npos; q0 += DIRECT_LANES)                               \
            acc += *(const mem *)(g + co * g_ld + q0);                                      \
        *(mem *)(lanes + co * DIRECT_LANES) += acc;                                         \
    }                                                                                       \
}

DYNAR_DIRECT_TAPS(float, f)
DYNAR_DIRECT_TAPS(double, d)
#undef DYNAR_DIRECT_TAPS

#endif
