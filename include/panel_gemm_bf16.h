/* The panel GEMM (include/panel_gemm.h) on bf16 operands with float32 sums, on AVX512_BF16's
 * VDPBF16PS, for the products with a convolution's weights in --precision bf16:
 *
 *     c (m, n) = a (m, k) @ b (k, n)  [+ bias[i] on every column of row i], row-major,
 *
 * a (the weights) packed once per call into bf16 panels, b float32 rounded to bf16 as each
 * strip of it is copied: the same passes and strips as the float32 kernel, with the depth in
 * pairs, because VDPBF16PS adds two products per float32 lane: acc[l] += a0 * b0[l] + a1 *
 * b1[l], each pair (a0, a1) one 32-bit unit of two halves, depth 2t low, 2t + 1 high.
 *
 * Panels: BF16_PANEL_ROWS rows of a; within a panel the depth in pairs, a pair as the rows'
 * units one after another: row i's halves of depth 2t, 2t + 1 sit at units
 * (i / BF16_PANEL_ROWS * pairs(k) + t) * BF16_PANEL_ROWS + i % BF16_PANEL_ROWS. Depth past k
 * and rows past m are zero. The strip: a pass's pairs, each BF16_PANEL_WIDTH columns of units
 * (column j's halves of depth 2t, 2t + 1), columns past n zero.
 *
 * The block: 8 rows x 3 vectors of 16 columns, 24 accumulators, as the float32 kernel's with
 * AVX-512, each vector now covering a pair of depth: per pair, 3 loads of the strip, 8
 * broadcast units of the panel, 24 VDPBF16PS.
 *
 * Rounding: the strip's conversion (VCVTNE2PS2BF16) is nearest-even with subnormals to zero
 * and NaN kept quiet, which is include/bf16.h's rule, the one the panels are packed with; the
 * tests hold the two to each other. The kernel is compiled for AVX512_BF16 whatever the
 * build's -march and runs only where dynar_bf16_features() says the CPU has it. */
#ifndef DYNAR_PANEL_GEMM_BF16_H
#define DYNAR_PANEL_GEMM_BF16_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

#define BF16_PANEL_ROWS 8
#define BF16_PANEL_VECTORS 3
#define BF16_PANEL_WIDTH (BF16_PANEL_VECTORS * 16)   /* columns of a strip */
/* Bytes of the stack strip, which bounds a pass's depth as the float32 kernel's does. */
#define BF16_STRIP_BYTES (64 * 1024)
#define BF16_MIN_PAIRS 32

static inline ptrdiff_t bf16_pairs(ptrdiff_t k) { return (k + 1) / 2; }

static inline ptrdiff_t bf16_panel_count(ptrdiff_t m)
{
    return (m + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;
}

/* Halves of the packed form of an m x k operand. */
static inline ptrdiff_t bf16_panel_size(ptrdiff_t m, ptrdiff_t k)
{
    return bf16_panel_count(m) * BF16_PANEL_ROWS * bf16_pairs(k) * 2;
}

/* Where element (i, j) of an operand of depth k lives in its panels, in halves: for kernels
 * that compute the operand straight into panel form (Winograd's transformed weights). */
static inline ptrdiff_t bf16_panel_offset(ptrdiff_t i, ptrdiff_t j, ptrdiff_t k)
{
    return (((i / BF16_PANEL_ROWS) * bf16_pairs(k) + j / 2) * BF16_PANEL_ROWS
            + i % BF16_PANEL_ROWS) * 2 + j % 2;
}

/* Panels [p0, p1) of a (m, k), element (i, j) at a[i * row_stride + j * col_stride], rounded
 * to bf16, with the zero padding. */
static void bf16_panel_pack(uint16_t *restrict panels, const float *restrict a, ptrdiff_t m,
                            ptrdiff_t k, ptrdiff_t row_stride, ptrdiff_t col_stride,
                            ptrdiff_t p0, ptrdiff_t p1)
{
    const ptrdiff_t pairs = bf16_pairs(k);
    for (ptrdiff_t p = p0; p < p1; p++)
        for (ptrdiff_t t = 0; t < pairs; t++)
            for (ptrdiff_t r = 0; r < BF16_PANEL_ROWS; r++)
                for (ptrdiff_t h = 0; h < 2; h++) {
                    const ptrdiff_t i = p * BF16_PANEL_ROWS + r, j = 2 * t + h;
                    panels[((p * pairs + t) * BF16_PANEL_ROWS + r) * 2 + h] = i < m && j < k
                        ? dynar_bf16_from_float(a[i * row_stride + j * col_stride]) : 0;
                }
}

/* Zeroes what bf16_panel_offset never addresses: rows past m, and depth k when k is odd. */
static void bf16_panel_zero_padding(uint16_t *restrict panels, ptrdiff_t m, ptrdiff_t k)
{
    const ptrdiff_t rows = bf16_panel_count(m) * BF16_PANEL_ROWS;
    for (ptrdiff_t i = 0; i < rows; i++)
        for (ptrdiff_t j = i < m ? k : 0; j < 2 * bf16_pairs(k); j++)
            panels[bf16_panel_offset(i, j, k)] = 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define BF16_HAVE_AVX512 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF16_INLINE static inline __attribute__((always_inline)) BF16_TARGET

/* Pairs [0, pairs) of rows k0.. of b (k, n), columns [j0, j0 + cols), cols <= WIDTH, into
 * the strip, rounded; depth past k and columns past cols zero. */
BF16_INLINE void bf16_strip_fill(uint32_t *restrict strip, const float *restrict b,
                                 ptrdiff_t ldb, ptrdiff_t k, ptrdiff_t k0, ptrdiff_t pairs,
                                 ptrdiff_t j0, ptrdiff_t cols)
{
    /* Interleaves the two halves of a VCVTNE2PS2BF16 result: its low 16 halves are the
     * even depth's columns, the high 16 the odd depth's. */
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (ptrdiff_t t = 0; t < pairs; t++) {
        const ptrdiff_t row = k0 + 2 * t;
        const float *even = b + row * ldb + j0;
        const float *odd = row + 1 < k ? even + ldb : NULL;
        for (int v = 0; v < BF16_PANEL_VECTORS; v++) {
            const ptrdiff_t left = cols - v * 16;
            const __mmask16 mask = left >= 16 ? 0xffff
                : left <= 0 ? 0 : (__mmask16) ((1u << left) - 1);
            const __m512 lo = _mm512_maskz_loadu_ps(mask, even + v * 16);
            const __m512 hi = odd ? _mm512_maskz_loadu_ps(mask, odd + v * 16)
                                  : _mm512_setzero_ps();
            const __m512i halves = (__m512i) _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_store_si512(strip + t * BF16_PANEL_WIDTH + v * 16,
                               _mm512_permutexvar_epi16(interleave, halves));
        }
    }
}

/* Rows [0, rows) of x, row i at x + i * ldx with its depth contiguous, pairs [0, pairs)
 * (pairs <= 16) from depth d0 on, rounded, as units dst[t * dst_stride + i] for i < width
 * (rows <= width <= 16; rows past `rows` zero): each row's pairs converted in one register,
 * then the 16 x 16 units transposed. Depth past k is zero. */
BF16_INLINE void bf16_units_transposed(uint32_t *restrict dst, ptrdiff_t dst_stride,
                                       const float *restrict x, ptrdiff_t ldx, int rows,
                                       int width, ptrdiff_t k, ptrdiff_t d0, int pairs)
{
    const ptrdiff_t left = k - d0;
    const __mmask16 lo_mask = left >= 16 ? 0xffff : (__mmask16) ((1u << left) - 1);
    const __mmask16 hi_mask = left >= 32 ? 0xffff
        : left <= 16 ? 0 : (__mmask16) ((1u << (left - 16)) - 1);
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) {
        if (i < rows) {
            const float *row = x + i * ldx + d0;
            r[i] = (__m512i) _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi_mask, row + 16),
                                                 _mm512_maskz_loadu_ps(lo_mask, row));
        } else
            r[i] = _mm512_setzero_si512();
    }
    /* Units (32 bits) in 4 steps: within pairs of rows, quads, 128-bit lanes twice. */
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) {
            r[i + j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
            r[i + j + 2] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
    /* r[j] now holds one pair of the 16 rows, in row order: pair j with its two low bits
     * swapped (the 64-bit step interleaves them). */
    const __mmask16 row_mask = width >= 16 ? 0xffff : (__mmask16) ((1u << width) - 1);
    for (int j = 0; j < 16; j++) {
        const int pair = (j & 12) | ((j & 1) << 1) | ((j >> 1) & 1);
        if (pair < pairs)
            _mm512_mask_storeu_epi32(dst + pair * dst_stride, row_mask, r[j]);
    }
}

/* One block of c: rows [0, rows) of a panel x nv vectors of columns, the last with `tail`
 * valid lanes, over `pairs` pairs. first: start from bias (or zero), else add to c. */
BF16_INLINE void bf16_panel_block(float *restrict c, ptrdiff_t ldc,
                                  const uint32_t *restrict panel,
                                  const uint32_t *restrict strip, ptrdiff_t pairs,
                                  const float *restrict bias, int first, int rows, int nv,
                                  int tail)
{
    __m512 acc[BF16_PANEL_ROWS][BF16_PANEL_VECTORS];
    for (int r = 0; r < BF16_PANEL_ROWS; r++)
        for (int v = 0; v < nv; v++) {
            const __mmask16 mask = v < nv - 1 ? 0xffff : (__mmask16) ((1u << tail) - 1);
            if (!first && r < rows)
                acc[r][v] = _mm512_maskz_loadu_ps(mask, c + r * ldc + v * 16);
            else
                acc[r][v] = _mm512_set1_ps(bias && r < rows ? bias[r] : 0.0f);
        }
    for (ptrdiff_t t = 0; t < pairs; t++) {
        __m512bh bv[BF16_PANEL_VECTORS];
        for (int v = 0; v < nv; v++)
            bv[v] = (__m512bh) _mm512_load_si512(strip + t * BF16_PANEL_WIDTH + v * 16);
        const uint32_t *at = panel + t * BF16_PANEL_ROWS;
        for (int r = 0; r < BF16_PANEL_ROWS; r++) {
            const __m512bh ar = (__m512bh) _mm512_set1_epi32((int) at[r]);
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++) {
            const __mmask16 mask = v < nv - 1 ? 0xffff : (__mmask16) ((1u << tail) - 1);
            _mm512_mask_storeu_ps(c + r * ldc + v * 16, mask, acc[r][v]);
        }
}

/* c (m, n) = a (m, k) @ op(b) [+ bias (m,) on every column] (or c += that, when add), a as
 * bf16 panels (units), op(b) (k, n) read a strip at a time: b (k, n) row-major, or b (n, k)
 * with the depth contiguous when b_transposed. */
BF16_INLINE void bf16_panels_times_strips(float *restrict c, ptrdiff_t ldc,
                                          const uint32_t *restrict units, ptrdiff_t m,
                                          ptrdiff_t k, const float *restrict b, ptrdiff_t ldb,
                                          int b_transposed, ptrdiff_t n,
                                          const float *restrict bias, int add,
                                          ptrdiff_t block_bytes)
{
    const ptrdiff_t pairs = bf16_pairs(k);
    ptrdiff_t max_pairs = block_bytes / (ptrdiff_t) (BF16_PANEL_ROWS * 4);
    if (max_pairs > BF16_STRIP_BYTES / (BF16_PANEL_WIDTH * 4))
        max_pairs = BF16_STRIP_BYTES / (BF16_PANEL_WIDTH * 4);
    if (max_pairs < BF16_MIN_PAIRS)
        max_pairs = BF16_MIN_PAIRS;
    const ptrdiff_t passes = (pairs + max_pairs - 1) / max_pairs;
    const ptrdiff_t depth = (pairs + passes - 1) / passes;     /* pairs of a pass */
    uint32_t strip[depth * BF16_PANEL_WIDTH] __attribute__((aligned(64)));
    for (ptrdiff_t t0 = 0; t0 < pairs; t0 += depth) {
        const ptrdiff_t kd = pairs - t0 < depth ? pairs - t0 : depth;
        const int first = t0 == 0 && !add;
        for (ptrdiff_t j0 = 0; j0 < n; j0 += BF16_PANEL_WIDTH) {
            const ptrdiff_t cols = n - j0 < BF16_PANEL_WIDTH ? n - j0 : BF16_PANEL_WIDTH;
            const int nv = (int) ((cols + 15) / 16);
            const int tail = (int) (cols - (nv - 1) * 16);
            if (!b_transposed)
                bf16_strip_fill(strip, b, ldb, k, 2 * t0, kd, j0, cols);
            else
                for (int v = 0; v < nv; v++)
                    for (ptrdiff_t t = 0; t < kd; t += 16)
                        bf16_units_transposed(strip + t * BF16_PANEL_WIDTH + v * 16,
                                              BF16_PANEL_WIDTH, b + (j0 + v * 16) * ldb, ldb,
                                              v < nv - 1 ? 16 : tail, 16, k, 2 * (t0 + t),
                                              kd - t < 16 ? (int) (kd - t) : 16);
            for (ptrdiff_t p = 0; p < bf16_panel_count(m); p++) {
                const ptrdiff_t i0 = p * BF16_PANEL_ROWS;
                const int rows = m - i0 < BF16_PANEL_ROWS ? (int) (m - i0) : BF16_PANEL_ROWS;
                const uint32_t *panel = units + (p * pairs + t0) * BF16_PANEL_ROWS;
                float *cb = c + i0 * ldc + j0;
                const float *pbias = bias ? bias + i0 : NULL;
                if (nv == BF16_PANEL_VECTORS && tail == 16 && rows == BF16_PANEL_ROWS)
                    bf16_panel_block(cb, ldc, panel, strip, kd, pbias, first,
                                     BF16_PANEL_ROWS, BF16_PANEL_VECTORS, 16);
                else if (nv == 1)
                    bf16_panel_block(cb, ldc, panel, strip, kd, pbias, first, rows, 1, tail);
                else if (nv == 2)
                    bf16_panel_block(cb, ldc, panel, strip, kd, pbias, first, rows, 2, tail);
                else
                    bf16_panel_block(cb, ldc, panel, strip, kd, pbias, first, rows,
                                     BF16_PANEL_VECTORS, tail);
            }
        }
    }
}

/* c (m, n) = a (m, k) @ op(b) [+ bias (m,) on every column], or c += that when add,
 * row-major; a packed by bf16_panel_pack; op(b) is b (k, n) row-major, or b^T for b (n, k)
 * with the depth contiguous when b_transposed; a panel's part of one pass fills at most
 * block_bytes. k == 0 leaves c = bias (or zero), or c. */
BF16_TARGET static void bf16_panel_gemm(float *restrict c, ptrdiff_t ldc,
                                        const uint16_t *restrict panels, ptrdiff_t m,
                                        ptrdiff_t k, const float *restrict b, ptrdiff_t ldb,
                                        int b_transposed, ptrdiff_t n,
                                        const float *restrict bias, ptrdiff_t block_bytes,
                                        int add)
{
    if (k == 0) {
        for (ptrdiff_t i = 0; i < m && !add; i++)
            for (ptrdiff_t j = 0; j < n; j++)
                c[i * ldc + j] = bias ? bias[i] : 0.0f;
        return;
    }
    bf16_panels_times_strips(c, ldc, (const uint32_t *) panels, m, k, b, ldb, b_transposed,
                             n, bias, add, block_bytes);
}

/* c (m, n) += a (m, k) @ b (n, k)^T, or = when !add: both operands new each call (a weight
 * gradient's), row-major with the depth contiguous, rounded as they are packed: a into
 * panels in `work` (bf16_panel_size(m, k) halves), b a strip at a time. */
BF16_TARGET static void bf16_gemm_nt(float *restrict c, ptrdiff_t ldc, const float *restrict a,
                                     ptrdiff_t lda, ptrdiff_t m, const float *restrict b,
                                     ptrdiff_t ldb, ptrdiff_t n, ptrdiff_t k,
                                     uint16_t *restrict work, ptrdiff_t block_bytes, int add)
{
    if (k == 0) {
        for (ptrdiff_t i = 0; i < m && !add; i++)
            for (ptrdiff_t j = 0; j < n; j++)
                c[i * ldc + j] = 0.0f;
        return;
    }
    const ptrdiff_t pairs = bf16_pairs(k);
    uint32_t *units = (uint32_t *) work;
    for (ptrdiff_t p = 0; p < bf16_panel_count(m); p++) {
        const ptrdiff_t i0 = p * BF16_PANEL_ROWS;
        const int rows = m - i0 < BF16_PANEL_ROWS ? (int) (m - i0) : BF16_PANEL_ROWS;
        for (ptrdiff_t t = 0; t < pairs; t += 16)
            bf16_units_transposed(units + (p * pairs + t) * BF16_PANEL_ROWS, BF16_PANEL_ROWS,
                                  a + i0 * lda, lda, rows, BF16_PANEL_ROWS, k, 2 * t,
                                  pairs - t < 16 ? (int) (pairs - t) : 16);
    }
    bf16_panels_times_strips(c, ldc, units, m, k, b, ldb, 1, n, NULL, add, block_bytes);
}
#else
#define BF16_HAVE_AVX512 0

static void bf16_panel_gemm(float *restrict c, ptrdiff_t ldc, const uint16_t *restrict panels,
                            ptrdiff_t m, ptrdiff_t k, const float *restrict b, ptrdiff_t ldb,
                            int b_transposed, ptrdiff_t n, const float *restrict bias,
                            ptrdiff_t block_bytes, int add)
{
    (void) c; (void) ldc; (void) panels; (void) m; (void) k; (void) b; (void) ldb;
    (void) b_transposed; (void) n; (void) bias; (void) block_bytes; (void) add;
    __builtin_trap();   /* never called: bf16_panel_gemm_runs() is 0 here */
}

static void bf16_gemm_nt(float *restrict c, ptrdiff_t ldc, const float *restrict a,
                         ptrdiff_t lda, ptrdiff_t m, const float *restrict b, ptrdiff_t ldb,
                         ptrdiff_t n, ptrdiff_t k, uint16_t *restrict work,
                         ptrdiff_t block_bytes, int add)
{
    (void) c; (void) ldc; (void) a; (void) lda; (void) m; (void) b; (void) ldb; (void) n;
    (void) k; (void) work; (void) block_bytes; (void) add;
    __builtin_trap();
}
#endif

/* Whether this build and CPU run bf16_panel_gemm. */
static inline int bf16_panel_gemm_runs(void)
{
    return BF16_HAVE_AVX512 && (dynar_bf16_features() & DYNAR_BF16_AVX512);
}

#endif
