/* The panel GEMM (include/panel_gemm.h) on bf16 operands with float32 sums, for the products
 * with a layer's weights in --precision bf16:
 *
 *     c (m, n) = a (m, k) @ b (k, n)  [+ bias[i] on every column of row i], row-major,
 *
 * a (the weights) packed once per call into bf16 panels, b float32 rounded to bf16 as each
 * strip of it is copied: the same passes and strips as the float32 kernel, with the depth in
 * pairs, because both x86 bf16 instructions add two products per float32 lane: a pair (a0,
 * a1) is one 32-bit unit of two halves, depth 2t low, 2t + 1 high.
 *
 * Panels: BF16_PANEL_ROWS (16) rows of a; within a panel the depth in blocks of
 * BF16_BLOCK_PAIRS (16) pairs, a block row by row (a row's 16 units, 64 bytes, then the next
 * row's), so that a block is an AMX tile of a as it lies. bf16_panel_unit says where unit
 * (i, t) sits. Rows past m, and depth past k up to a whole block, are zero. The strip: a
 * pass's pairs (whole blocks), each BF16_PANEL_WIDTH columns of units (column j's halves of
 * depth 2t, 2t + 1), depth past k and columns past n zero; 16 pairs of 16 of its columns are
 * an AMX tile of b as it lies.
 *
 * Three kernels on those panels, the caller's `kernel` (DYNAR_BF16_* of bf16.h), two on
 * x86 on those strips and aarch64's on a strip of its own (below, where it is defined):
 * - DYNAR_BF16_AMX, AMX tiles: TDPBF16PS adds a 16 x 32 tile of a times a 32 x 16 tile of b to
 *   a 16 x 16 float32 tile of c. A block of c is a panel x the strip's 3 tiles of columns: per
 *   16 pairs, 4 tile loads and 3 TDPBF16PS.
 * - DYNAR_BF16_AVX512, VDPBF16PS: acc[l] += a0 * b0[l] + a1 * b1[l]. A block of c is half a
 *   panel (8 rows) x 3 vectors of 16 columns, 24 accumulators: per pair, 3 loads of the strip,
 *   8 broadcast units of the panel, 24 VDPBF16PS.
 * - DYNAR_BF16_ARM, BFMMLA: 2 x 4 times 4 x 2, read from the panels as they lie.
 * Each sums an element's pairs in depth order across passes, so the passes (block_bytes)
 * never change a result; the kernels differ from each other in summation order only.
 *
 * Rounding: the strip's conversion (VCVTNE2PS2BF16; on aarch64 bf16.h's integer steps in
 * NEON lanes) is nearest-even with subnormals to zero and NaN kept quiet, which is
 * include/bf16.h's rule, the one the panels are packed with; the tests hold the two to each
 * other. The kernels are compiled for their instructions whatever
 * the build's -march and run only where dynar_bf16_features() says the CPU (and, for AMX,
 * Linux) lets them. */
#ifndef DYNAR_PANEL_GEMM_BF16_H
#define DYNAR_PANEL_GEMM_BF16_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

#define BF16_PANEL_ROWS 16
#define BF16_BLOCK_PAIRS 16
#define BF16_PANEL_VECTORS 3
#define BF16_PANEL_WIDTH (BF16_PANEL_VECTORS * 16)   /* columns of a strip */
/* Bytes of the stack strip, which bounds a pass's depth as the float32 kernel's does. */
#define BF16_STRIP_BYTES (64 * 1024)
#define BF16_MIN_PAIRS 32

static inline ptrdiff_t bf16_pairs(ptrdiff_t k) { return (k + 1) / 2; }

/* Pairs of a panel's depth: k's pairs in whole blocks. */
static inline ptrdiff_t bf16_panel_pairs(ptrdiff_t k)
{
    return (bf16_pairs(k) + BF16_BLOCK_PAIRS - 1) / BF16_BLOCK_PAIRS * BF16_BLOCK_PAIRS;
}

static inline ptrdiff_t bf16_panel_count(ptrdiff_t m)
{
    return (m + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;
}

/* Halves of the packed form of an m x k operand. */
static inline ptrdiff_t bf16_panel_size(ptrdiff_t m, ptrdiff_t k)
{
    return bf16_panel_count(m) * BF16_PANEL_ROWS * bf16_panel_pairs(k) * 2;
}

/* Where the unit of row i, pair t of an operand of depth k lives in its panels. */
static inline ptrdiff_t bf16_panel_unit(ptrdiff_t i, ptrdiff_t t, ptrdiff_t k)
{
    return (i / BF16_PANEL_ROWS * bf16_panel_pairs(k) + t / BF16_BLOCK_PAIRS * BF16_BLOCK_PAIRS)
               * BF16_PANEL_ROWS
           + i % BF16_PANEL_ROWS * BF16_BLOCK_PAIRS + t % BF16_BLOCK_PAIRS;
}

/* Where element (i, j) of an operand of depth k lives in its panels, in halves: for kernels
 * that compute the operand straight into panel form (Winograd's transformed weights). */
static inline ptrdiff_t bf16_panel_offset(ptrdiff_t i, ptrdiff_t j, ptrdiff_t k)
{
    return bf16_panel_unit(i, j / 2, k) * 2 + j % 2;
}

/* Taps bf16_panel_pack_taps gathers at once: a 3x3 kernel's, in an 18 KB buffer. */
#define BF16_PACK_TAPS 9

/* Panels [p0, p1) of `taps` operands of shape (m, k) packed at once, tap t's element (i, j)
 * at a[i * row_stride + j * col_stride + t], rounded to bf16, with the zero padding: tap t's
 * panels start tap_stride halves after tap t - 1's. (One operand: taps 1; a convolution's
 * weights (C_out, C_in, kh, kw) are kh * kw operands, one per kernel tap, interleaved.)
 * A panel's depth block (16 rows x 32 values, a row's values adjacent when packed) is
 * gathered first, for up to BF16_PACK_TAPS taps, into a buffer that stays in L1: whichever
 * stride is the long one, the gather then walks a few kilobytes of `a`, and each packed row
 * is stored whole. Packing element by element, a store of two bytes each at an index
 * computed each time, ran at about 10 cycles an element. */
static void bf16_panel_pack_taps(uint16_t *restrict panels, ptrdiff_t tap_stride,
                                 const float *restrict a, ptrdiff_t m, ptrdiff_t k,
                                 ptrdiff_t row_stride, ptrdiff_t col_stride, int taps,
                                 ptrdiff_t p0, ptrdiff_t p1)
{
    enum { ROWS = BF16_PANEL_ROWS, DEPTH = 2 * BF16_BLOCK_PAIRS };
    float block[BF16_PACK_TAPS][ROWS][DEPTH];
    for (int t0 = 0; t0 < taps; t0 += BF16_PACK_TAPS) {
        const int group = taps - t0 < BF16_PACK_TAPS ? taps - t0 : BF16_PACK_TAPS;
        for (ptrdiff_t p = p0; p < p1; p++)
            for (ptrdiff_t u = 0; u < bf16_panel_pairs(k); u += BF16_BLOCK_PAIRS) {
                for (int r = 0; r < ROWS; r++) {
                    const ptrdiff_t i = p * ROWS + r;
                    for (int d = 0; d < DEPTH; d++) {
                        const ptrdiff_t j = 2 * u + d;
                        const float *src = a + i * row_stride + j * col_stride + t0;
                        const int inside = i < m && j < k;
                        for (int t = 0; t < group; t++)
                            block[t][r][d] = inside ? src[t] : 0.0f;
                    }
                }
                for (int t = 0; t < group; t++)
                    for (int r = 0; r < ROWS; r++) {
                        uint16_t *row = panels + (t0 + t) * tap_stride
                                        + 2 * bf16_panel_unit(p * ROWS + r, u, k);
                        for (int d = 0; d < DEPTH; d++)
                            row[d] = dynar_bf16_from_float(block[t][r][d]);
                    }
            }
    }
}

/* Panels [p0, p1) of a (m, k), element (i, j) at a[i * row_stride + j * col_stride], rounded
 * to bf16, with the zero padding. */
static inline void bf16_panel_pack(uint16_t *restrict panels, const float *restrict a,
                                   ptrdiff_t m, ptrdiff_t k, ptrdiff_t row_stride,
                                   ptrdiff_t col_stride, ptrdiff_t p0, ptrdiff_t p1)
{
    bf16_panel_pack_taps(panels, 0, a, m, k, row_stride, col_stride, 1, p0, p1);
}

/* Zeroes what an operand's own elements leave of its panels: rows past m, depth past k. */
static void bf16_panel_zero_padding(uint16_t *restrict panels, ptrdiff_t m, ptrdiff_t k)
{
    const ptrdiff_t rows = bf16_panel_count(m) * BF16_PANEL_ROWS;
    const ptrdiff_t depth = 2 * bf16_panel_pairs(k);
    for (ptrdiff_t i = 0; i < rows; i++)
        for (ptrdiff_t j = i < m ? k : 0; j < depth; j++)
            panels[bf16_panel_offset(i, j, k)] = 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define BF16_HAVE_X86 1
#define BF16_HAVE_ARM 0
/* AMX's intrinsics came with GCC 11 and clang 12; older compilers build the rest. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define BF16_HAVE_AMX 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#else
#define BF16_HAVE_AMX 0
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif
#define BF16_INLINE static inline __attribute__((always_inline)) BF16_TARGET
/* The tile instructions' asm does not tell the compiler which memory they read or write. */
#define BF16_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

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
        const float *even = row < k ? b + row * ldb + j0 : NULL;
        const float *odd = row + 1 < k ? even + ldb : NULL;
        for (int v = 0; v < BF16_PANEL_VECTORS; v++) {
            const ptrdiff_t left = cols - v * 16;
            const __mmask16 mask = left >= 16 ? 0xffff
                : left <= 0 ? 0 : (__mmask16) ((1u << left) - 1);
            const __m512 lo = even ? _mm512_maskz_loadu_ps(mask, even + v * 16)
                                   : _mm512_setzero_ps();
            const __m512 hi = odd ? _mm512_maskz_loadu_ps(mask, odd + v * 16)
                                  : _mm512_setzero_ps();
            const __m512i halves = (__m512i) _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_store_si512(strip + t * BF16_PANEL_WIDTH + v * 16,
                               _mm512_permutexvar_epi16(interleave, halves));
        }
    }
}

/* The mask of the first `count` of 16 lanes (count may be <= 0 or >= 16). */
BF16_INLINE __mmask16 bf16_lanes(ptrdiff_t count)
{
    return count >= 16 ? 0xffff : count <= 0 ? 0 : (__mmask16) ((1u << count) - 1);
}

/* Rows [0, rows) of x, row i at x + i * ldx with its depth contiguous, pairs [0, pairs)
 * (pairs <= 16) from depth d0 on, rounded, as units dst[t * dst_stride + i] for i < width
 * (rows <= width <= 16; rows past `rows` zero): each row's pairs converted in one register,
 * then the 16 x 16 units transposed. Depth past k is zero. */
BF16_INLINE void bf16_units_transposed(uint32_t *restrict dst, ptrdiff_t dst_stride,
                                       const float *restrict x, ptrdiff_t ldx, int rows,
                                       int width, ptrdiff_t k, ptrdiff_t d0, int pairs)
{
    const __mmask16 lo_mask = bf16_lanes(k - d0), hi_mask = bf16_lanes(k - d0 - 16);
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
    const __mmask16 row_mask = bf16_lanes(width);
    for (int j = 0; j < 16; j++) {
        const int pair = (j & 12) | ((j & 1) << 1) | ((j >> 1) & 1);
        if (pair < pairs)
            _mm512_mask_storeu_epi32(dst + pair * dst_stride, row_mask, r[j]);
    }
}

/* VDPBF16PS: one block of c, rows [0, rows) of a half panel (from `panel`, the unit of its
 * first row at the pass's first pair) x nv vectors of columns, the last with `tail` valid
 * lanes, over `pairs` pairs. first: start from bias (or zero), else add to c. */
BF16_INLINE void bf16_avx512_block(float *restrict c, ptrdiff_t ldc,
                                   const uint32_t *restrict panel,
                                   const uint32_t *restrict strip, ptrdiff_t pairs,
                                   const float *restrict bias, int first, int rows, int nv,
                                   int tail)
{
    enum { ROWS = BF16_PANEL_ROWS / 2 };
    __m512 acc[ROWS][BF16_PANEL_VECTORS];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < nv; v++) {
            const __mmask16 mask = bf16_lanes(v < nv - 1 ? 16 : tail);
            if (!first && r < rows)
                acc[r][v] = _mm512_maskz_loadu_ps(mask, c + r * ldc + v * 16);
            else
                acc[r][v] = _mm512_set1_ps(bias && r < rows ? bias[r] : 0.0f);
        }
    for (ptrdiff_t t0 = 0; t0 < pairs; t0 += BF16_BLOCK_PAIRS) {
        const uint32_t *block = panel + t0 * BF16_PANEL_ROWS;
        const int block_pairs = (int) (pairs - t0 < BF16_BLOCK_PAIRS ? pairs - t0
                                                                     : BF16_BLOCK_PAIRS);
        for (int t = 0; t < block_pairs; t++) {
            __m512bh bv[BF16_PANEL_VECTORS];
            for (int v = 0; v < nv; v++)
                bv[v] = (__m512bh) _mm512_load_si512(strip + (t0 + t) * BF16_PANEL_WIDTH
                                                     + v * 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh ar = (__m512bh) _mm512_set1_epi32(
                    (int) block[r * BF16_BLOCK_PAIRS + t]);
                for (int v = 0; v < nv; v++)
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            _mm512_mask_storeu_ps(c + r * ldc + v * 16, bf16_lanes(v < nv - 1 ? 16 : tail),
                                  acc[r][v]);
}

#if BF16_HAVE_AMX
/* The tiles' shapes for LDTILECFG (palette 1): c's three in tiles 0-2, a's in 3, b's in
 * 4-6, each 16 rows of 64 bytes. */
struct bf16_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t row_bytes[16];
    uint8_t rows[16];
};

BF16_INLINE void bf16_amx_configure(void)
{
    struct bf16_tile_config config = {0};
    config.palette = 1;
    for (int i = 0; i < 7; i++) {
        config.rows[i] = 16;
        config.row_bytes[i] = 64;
    }
    BF16_MEMORY_BARRIER();
    _tile_loadconfig(&config);
}

/* AMX: one block of c, rows [0, rows) of a panel (from `panel`, its unit at the pass's first
 * pair) x nv tiles of 16 columns, the last with `tail` valid columns, over `pairs` pairs
 * (whole blocks). first: start from bias (or zero), else add to c. Tiles of c cut by its
 * edges go through `edge`, whole ones straight to and from c. */
BF16_INLINE void bf16_amx_block(float *restrict c, ptrdiff_t ldc,
                                const uint32_t *restrict panel,
                                const uint32_t *restrict strip, ptrdiff_t pairs,
                                const float *restrict bias, int first, int rows, int nv,
                                int tail)
{
    float edge[BF16_PANEL_VECTORS][16 * 16] __attribute__((aligned(64)));
    float *tile[BF16_PANEL_VECTORS];
    ptrdiff_t ld[BF16_PANEL_VECTORS];
    for (int v = 0; v < nv; v++) {
        const int cols = v < nv - 1 ? 16 : tail;
        const int whole = rows == 16 && cols == 16;
        tile[v] = whole ? c + v * 16 : edge[v];
        ld[v] = whole ? ldc : 16;
        if (whole && !first)
            continue;
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < 16; j++)
                tile[v][r * ld[v] + j] = !first && r < rows && j < cols
                    ? c[r * ldc + v * 16 + j] : bias && r < rows ? bias[r] : 0.0f;
    }
    BF16_MEMORY_BARRIER();
    _tile_loadd(0, tile[0], ld[0] * 4);
    if (nv > 1)
        _tile_loadd(1, tile[1], ld[1] * 4);
    if (nv > 2)
        _tile_loadd(2, tile[2], ld[2] * 4);
    for (ptrdiff_t t = 0; t < pairs; t += BF16_BLOCK_PAIRS) {
        const uint32_t *b = strip + t * BF16_PANEL_WIDTH;
        _tile_loadd(3, panel + t * BF16_PANEL_ROWS, BF16_BLOCK_PAIRS * 4);
        _tile_loadd(4, b, BF16_PANEL_WIDTH * 4);
        _tile_dpbf16ps(0, 3, 4);
        if (nv > 1) {
            _tile_loadd(5, b + 16, BF16_PANEL_WIDTH * 4);
            _tile_dpbf16ps(1, 3, 5);
        }
        if (nv > 2) {
            _tile_loadd(6, b + 32, BF16_PANEL_WIDTH * 4);
            _tile_dpbf16ps(2, 3, 6);
        }
    }
    _tile_stored(0, tile[0], ld[0] * 4);
    if (nv > 1)
        _tile_stored(1, tile[1], ld[1] * 4);
    if (nv > 2)
        _tile_stored(2, tile[2], ld[2] * 4);
    BF16_MEMORY_BARRIER();
    for (int v = 0; v < nv; v++)
        if (tile[v] == edge[v])
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < (v < nv - 1 ? 16 : tail); j++)
                    c[r * ldc + v * 16 + j] = edge[v][r * 16 + j];
}
#endif

/* One panel of c against the strip on `kernel`: its rows [0, rows), the strip's nv vectors
 * of columns (the last with `tail`), over `pairs` pairs. */
BF16_INLINE void bf16_panel_block(int kernel, float *restrict c, ptrdiff_t ldc,
                                  const uint32_t *restrict panel,
                                  const uint32_t *restrict strip, ptrdiff_t pairs,
                                  const float *restrict bias, int first, int rows, int nv,
                                  int tail)
{
#if BF16_HAVE_AMX
    if (kernel == DYNAR_BF16_AMX) {
        bf16_amx_block(c, ldc, panel, strip, pairs, bias, first, rows, nv, tail);
        return;
    }
#else
    (void) kernel;
#endif
    for (int half = 0; half < 2 && half * 8 < rows; half++)
        bf16_avx512_block(c + half * 8 * ldc, ldc, panel + half * 8 * BF16_BLOCK_PAIRS, strip,
                          pairs, bias ? bias + half * 8 : NULL, first,
                          rows - half * 8 < 8 ? rows - half * 8 : 8, nv, tail);
}

/* As bf16_strip_fill, from op(b) = b^T for b (n, k) with the depth contiguous. */
BF16_INLINE void bf16_strip_fill_transposed(uint32_t *restrict strip, const float *restrict b,
                                            ptrdiff_t ldb, ptrdiff_t k, ptrdiff_t k0,
                                            ptrdiff_t pairs, ptrdiff_t j0, ptrdiff_t cols)
{
    for (int v = 0; v * 16 < cols; v++)
        for (ptrdiff_t t = 0; t < pairs; t += 16)
            bf16_units_transposed(strip + t * BF16_PANEL_WIDTH + v * 16, BF16_PANEL_WIDTH,
                                  b + (j0 + v * 16) * ldb, ldb,
                                  cols - v * 16 < 16 ? (int) (cols - v * 16) : 16, 16, k,
                                  k0 + 2 * t, 16);
}

/* a (m, k), its depth contiguous, rounded into whole panels (bf16_panel_size(m, k) halves):
 * a block's rows are each row's 16 pairs as they lie, rounded in one register. */
BF16_INLINE void bf16_pack_depth_rows(uint32_t *restrict units, const float *restrict a,
                                      ptrdiff_t lda, ptrdiff_t m, ptrdiff_t k)
{
    for (ptrdiff_t i = 0; i < bf16_panel_count(m) * BF16_PANEL_ROWS; i++)
        for (ptrdiff_t t = 0; t < bf16_panel_pairs(k); t += BF16_BLOCK_PAIRS) {
            const float *row = a + i * lda + 2 * t;
            const ptrdiff_t left = i < m ? k - 2 * t : 0;
            const __m512 lo = _mm512_maskz_loadu_ps(bf16_lanes(left), row);
            const __m512 hi = _mm512_maskz_loadu_ps(bf16_lanes(left - 16), row + 16);
            _mm512_storeu_si512(units + bf16_panel_unit(i, t, k),
                                (__m512i) _mm512_cvtne2ps_pbh(hi, lo));
        }
}
#elif defined(__aarch64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
/* aarch64 FEAT_BF16: BFMMLA acc, A, B adds A (2 x 4) @ B^T (4 x 2), two rows and two columns
 * of four halves each, to the 2 x 2 float32 block in acc. A is read from the panels as they
 * are (a row's 4 halves of one quad are 2 adjacent units, 8 bytes); the strip is this
 * kernel's own: per quad of depth, BF16_PANEL_WIDTH / 2 column pairs of 8 halves (column
 * 2p's 4, then column 2p + 1's), each a B register as it lies. A block of c is 8 rows x 8
 * columns, 16 accumulators: per two quads, 8 loads of the panel zipped into 4 + 4 A
 * registers, 8 loads of the strip, 32 BFMMLA. */
#include <arm_neon.h>
#define BF16_HAVE_X86 0
#define BF16_HAVE_AMX 0
#define BF16_HAVE_ARM 1
#define BF16_TARGET __attribute__((target("arch=armv8.2-a+bf16")))
#define BF16_INLINE static inline __attribute__((always_inline)) BF16_TARGET
#define BF16_STRIP_COLUMN_PAIRS (BF16_PANEL_WIDTH / 2)

/* 4 floats from p: the first `count` of them (count may be <= 0 or >= 4), the rest zero. */
static inline float32x4_t bf16_load4(const float *p, ptrdiff_t count)
{
    if (count >= 4)
        return vld1q_f32(p);
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (ptrdiff_t i = 0; i < count; i++)
        v[i] = p[i];
    return vld1q_f32(v);
}

/* include/bf16.h's rounding, on 4 lanes (the same integer steps as dynar_bf16_from_float:
 * BFCVT's treatment of subnormals follows FPCR, this does not). */
static inline uint16x4_t bf16_round4(float32x4_t x)
{
    const uint32x4_t bits = vreinterpretq_u32_f32(x);
    const uint32x4_t upper = vshrq_n_u32(bits, 16);
    const uint32x4_t magnitude = vandq_u32(bits, vdupq_n_u32(0x7fffffffu));
    const uint32x4_t odd = vandq_u32(upper, vdupq_n_u32(1));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7fffu)), odd),
                                           16);
    const uint32x4_t quiet_nan = vorrq_u32(upper, vdupq_n_u32(0x0040u));
    const uint32x4_t signed_zero = vandq_u32(upper, vdupq_n_u32(0x8000u));
    uint32x4_t result = vbslq_u32(vcgtq_u32(magnitude, vdupq_n_u32(0x7f800000u)), quiet_nan,
                                  rounded);
    result = vbslq_u32(vcltq_u32(magnitude, vdupq_n_u32(0x00800000u)), signed_zero, result);
    return vmovn_u32(result);
}

/* Pairs [0, pairs) (whole quads) of rows k0.. of b (k, n), columns [j0, j0 + cols), into the
 * strip, rounded; depth past k and columns past cols zero. Four rows of four columns are
 * rounded, then transposed into the four columns' quads. */
BF16_INLINE void bf16_strip_fill(uint32_t *restrict strip, const float *restrict b,
                                 ptrdiff_t ldb, ptrdiff_t k, ptrdiff_t k0, ptrdiff_t pairs,
                                 ptrdiff_t j0, ptrdiff_t cols)
{
    uint16_t *halves = (uint16_t *) strip;
    for (ptrdiff_t q = 0; q < pairs / 2; q++)
        for (ptrdiff_t j = 0; j < BF16_PANEL_WIDTH; j += 4) {
            uint16x4_t r[4];
            for (int h = 0; h < 4; h++) {
                const ptrdiff_t d = k0 + 4 * q + h;
                r[h] = d < k ? bf16_round4(bf16_load4(b + d * ldb + j0 + j, cols - j))
                             : vdup_n_u16(0);
            }
            const uint16x4x2_t t01 = vtrn_u16(r[0], r[1]), t23 = vtrn_u16(r[2], r[3]);
            /* columns 0 and 2, then 1 and 3 */
            const uint32x2x2_t c02 = vtrn_u32(vreinterpret_u32_u16(t01.val[0]),
                                              vreinterpret_u32_u16(t23.val[0]));
            const uint32x2x2_t c13 = vtrn_u32(vreinterpret_u32_u16(t01.val[1]),
                                              vreinterpret_u32_u16(t23.val[1]));
            uint16_t *dst = halves + (q * BF16_STRIP_COLUMN_PAIRS + j / 2) * 8;
            vst1q_u16(dst, vcombine_u16(vreinterpret_u16_u32(c02.val[0]),
                                        vreinterpret_u16_u32(c13.val[0])));
            vst1q_u16(dst + 8, vcombine_u16(vreinterpret_u16_u32(c02.val[1]),
                                            vreinterpret_u16_u32(c13.val[1])));
        }
}

/* As bf16_strip_fill, from op(b) = b^T for b (n, k) with the depth contiguous: a column's
 * quad is 4 adjacent values. */
BF16_INLINE void bf16_strip_fill_transposed(uint32_t *restrict strip, const float *restrict b,
                                            ptrdiff_t ldb, ptrdiff_t k, ptrdiff_t k0,
                                            ptrdiff_t pairs, ptrdiff_t j0, ptrdiff_t cols)
{
    uint16_t *halves = (uint16_t *) strip;
    for (ptrdiff_t q = 0; q < pairs / 2; q++) {
        const ptrdiff_t d = k0 + 4 * q;
        for (ptrdiff_t j = 0; j < BF16_PANEL_WIDTH; j += 2) {
            const uint16x4_t even = j < cols
                ? bf16_round4(bf16_load4(b + (j0 + j) * ldb + d, k - d)) : vdup_n_u16(0);
            const uint16x4_t odd = j + 1 < cols
                ? bf16_round4(bf16_load4(b + (j0 + j + 1) * ldb + d, k - d)) : vdup_n_u16(0);
            vst1q_u16(halves + (q * BF16_STRIP_COLUMN_PAIRS + j / 2) * 8,
                      vcombine_u16(even, odd));
        }
    }
}

/* a (m, k), its depth contiguous, rounded into whole panels (bf16_panel_size(m, k) halves). */
BF16_INLINE void bf16_pack_depth_rows(uint32_t *restrict units, const float *restrict a,
                                      ptrdiff_t lda, ptrdiff_t m, ptrdiff_t k)
{
    bf16_panel_pack((uint16_t *) units, a, m, k, lda, 1, 0, bf16_panel_count(m));
}

/* One block of c: rows [0, rows) of a half panel (from `panel`, its first row's unit at the
 * pass's first pair) x columns [0, cols) (from `strip`, the block's first column pair of the
 * pass's first quad), over `quads` quads (even). first: start from bias (or zero), else add
 * to c. acc[i][j] is c's 2 x 2 block at rows 2i, columns 2j. */
BF16_INLINE void bf16_bfmmla_block(float *restrict c, ptrdiff_t ldc,
                                   const uint32_t *restrict panel,
                                   const uint16_t *restrict strip, ptrdiff_t quads,
                                   const float *restrict bias, int first, int rows, int cols)
{
    float t[8][8];
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 8; j++)
            t[r][j] = r >= rows ? 0.0f : !first ? (j < cols ? c[r * ldc + j] : 0.0f)
                    : bias ? bias[r] : 0.0f;
    float32x4_t acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            acc[i][j] = vcombine_f32(vld1_f32(&t[2 * i][2 * j]),
                                     vld1_f32(&t[2 * i + 1][2 * j]));
    for (ptrdiff_t q = 0; q < quads; q += 2) {
        /* A row's quads q and q + 1: its 4 units from pair 2q on, read as the halves the
         * packers store (one access type for the panels on this path). */
        const uint16_t *units = (const uint16_t *) (
            panel + 2 * q / BF16_BLOCK_PAIRS * BF16_BLOCK_PAIRS * BF16_PANEL_ROWS
            + 2 * q % BF16_BLOCK_PAIRS);
        bfloat16x8_t a[2][4];
        for (int i = 0; i < 4; i++) {
            const uint64x2_t even = vreinterpretq_u64_u16(
                vld1q_u16(units + 2 * 2 * i * BF16_BLOCK_PAIRS));
            const uint64x2_t odd = vreinterpretq_u64_u16(
                vld1q_u16(units + 2 * (2 * i + 1) * BF16_BLOCK_PAIRS));
            a[0][i] = vreinterpretq_bf16_u64(vzip1q_u64(even, odd));
            a[1][i] = vreinterpretq_bf16_u64(vzip2q_u64(even, odd));
        }
        for (int s = 0; s < 2; s++) {
            const uint16_t *quad = strip + (q + s) * BF16_STRIP_COLUMN_PAIRS * 8;
            for (int j = 0; j < 4; j++) {
                const bfloat16x8_t bj = vreinterpretq_bf16_u16(vld1q_u16(quad + 8 * j));
                for (int i = 0; i < 4; i++)
                    acc[i][j] = vbfmmlaq_f32(acc[i][j], a[s][i], bj);
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            vst1_f32(&t[2 * i][2 * j], vget_low_f32(acc[i][j]));
            vst1_f32(&t[2 * i + 1][2 * j], vget_high_f32(acc[i][j]));
        }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            c[r * ldc + j] = t[r][j];
}

/* One panel of c against the strip: its rows [0, rows), the strip's nv vectors of 16
 * columns (the last with `tail`), over `pairs` pairs, run in whole pairs of quads (the
 * padding past them is zero). */
BF16_INLINE void bf16_panel_block(int kernel, float *restrict c, ptrdiff_t ldc,
                                  const uint32_t *restrict panel,
                                  const uint32_t *restrict strip, ptrdiff_t pairs,
                                  const float *restrict bias, int first, int rows, int nv,
                                  int tail)
{
    (void) kernel;
    const int cols = (nv - 1) * 16 + tail;
    const ptrdiff_t quads = (pairs + 3) / 4 * 2;
    for (int half = 0; half * 8 < rows; half++)
        for (int j = 0; j < cols; j += 8)
            bf16_bfmmla_block(c + half * 8 * ldc + j, ldc,
                              panel + half * 8 * BF16_BLOCK_PAIRS,
                              (const uint16_t *) strip + j / 2 * 8, quads,
                              bias ? bias + half * 8 : NULL, first,
                              rows - half * 8 < 8 ? rows - half * 8 : 8,
                              cols - j < 8 ? cols - j : 8);
}

#else
#define BF16_HAVE_X86 0
#define BF16_HAVE_AMX 0
#define BF16_HAVE_ARM 0
#endif

#if BF16_HAVE_X86 || BF16_HAVE_ARM
/* c (m, n) = a (m, k) @ op(b) [+ bias (m,) on every column] (or c += a @ op(b), bias unread,
 * when add), a as
 * bf16 panels (units), op(b) (k, n) read a strip at a time: b (k, n) row-major, or b (n, k)
 * with the depth contiguous when b_transposed. */
BF16_INLINE void bf16_panels_times_strips(int kernel, float *restrict c, ptrdiff_t ldc,
                                          const uint32_t *restrict units, ptrdiff_t m,
                                          ptrdiff_t k, const float *restrict b, ptrdiff_t ldb,
                                          int b_transposed, ptrdiff_t n,
                                          const float *restrict bias, int add,
                                          ptrdiff_t block_bytes)
{
    const ptrdiff_t pairs = bf16_pairs(k), panel_pairs = bf16_panel_pairs(k);
    /* A pass's pairs: half a panel's part of it (what a VDPBF16PS block reads) fills
     * block_bytes, in whole blocks. */
    ptrdiff_t max_pairs = block_bytes / (ptrdiff_t) (BF16_PANEL_ROWS / 2 * 4);
    if (max_pairs > BF16_STRIP_BYTES / (BF16_PANEL_WIDTH * 4))
        max_pairs = BF16_STRIP_BYTES / (BF16_PANEL_WIDTH * 4);
    if (max_pairs < BF16_MIN_PAIRS)
        max_pairs = BF16_MIN_PAIRS;
    max_pairs = max_pairs / BF16_BLOCK_PAIRS * BF16_BLOCK_PAIRS;
    const ptrdiff_t passes = (panel_pairs + max_pairs - 1) / max_pairs;
    const ptrdiff_t blocks = panel_pairs / BF16_BLOCK_PAIRS;
    const ptrdiff_t depth = (blocks + passes - 1) / passes * BF16_BLOCK_PAIRS;
    uint32_t strip[depth * BF16_PANEL_WIDTH] __attribute__((aligned(64)));
#if BF16_HAVE_AMX
    if (kernel == DYNAR_BF16_AMX)
        bf16_amx_configure();
#endif
    for (ptrdiff_t t0 = 0; t0 < panel_pairs; t0 += depth) {
        const ptrdiff_t kd = panel_pairs - t0 < depth ? panel_pairs - t0 : depth;
        /* The pairs VDPBF16PS runs: the padding's products are zero. */
        const ptrdiff_t live = pairs - t0 < kd ? pairs - t0 : kd;
        const int first = t0 == 0 && !add;
        for (ptrdiff_t j0 = 0; j0 < n; j0 += BF16_PANEL_WIDTH) {
            const ptrdiff_t cols = n - j0 < BF16_PANEL_WIDTH ? n - j0 : BF16_PANEL_WIDTH;
            const int nv = (int) ((cols + 15) / 16);
            const int tail = (int) (cols - (nv - 1) * 16);
            if (!b_transposed)
                bf16_strip_fill(strip, b, ldb, k, 2 * t0, kd, j0, cols);
            else
                bf16_strip_fill_transposed(strip, b, ldb, k, 2 * t0, kd, j0, cols);
            for (ptrdiff_t p = 0; p < bf16_panel_count(m); p++) {
                const ptrdiff_t i0 = p * BF16_PANEL_ROWS;
                const int rows = m - i0 < BF16_PANEL_ROWS ? (int) (m - i0) : BF16_PANEL_ROWS;
                const uint32_t *panel = units + (p * panel_pairs + t0) * BF16_PANEL_ROWS;
                float *cb = c + i0 * ldc + j0;
                const float *pbias = bias ? bias + i0 : NULL;
                const ptrdiff_t run = kernel == DYNAR_BF16_AMX ? kd : live;
                if (nv == BF16_PANEL_VECTORS && tail == 16 && rows == BF16_PANEL_ROWS)
                    bf16_panel_block(kernel, cb, ldc, panel, strip, run, pbias, first,
                                     BF16_PANEL_ROWS, BF16_PANEL_VECTORS, 16);
                else if (nv == 1)
                    bf16_panel_block(kernel, cb, ldc, panel, strip, run, pbias, first, rows, 1,
                                     tail);
                else if (nv == 2)
                    bf16_panel_block(kernel, cb, ldc, panel, strip, run, pbias, first, rows, 2,
                                     tail);
                else
                    bf16_panel_block(kernel, cb, ldc, panel, strip, run, pbias, first, rows,
                                     BF16_PANEL_VECTORS, tail);
            }
        }
    }
#if BF16_HAVE_AMX
    if (kernel == DYNAR_BF16_AMX)
        _tile_release();
#endif
}

/* c (m, n) = a (m, k) @ op(b) [+ bias (m,) on every column], or c += a @ op(b) when add
 * (bias unread), row-major, on `kernel` (DYNAR_BF16_AVX512 or DYNAR_BF16_AMX); a packed by
 * bf16_panel_pack; op(b) is b (k, n) row-major, or b^T for b (n, k) with the depth
 * contiguous when b_transposed; half a panel's part of one pass fills at most block_bytes.
 * k == 0 leaves c = bias (or zero), or c. */
BF16_TARGET static void bf16_panel_gemm(int kernel, float *restrict c, ptrdiff_t ldc,
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
    bf16_panels_times_strips(kernel, c, ldc, (const uint32_t *) panels, m, k, b, ldb,
                             b_transposed, n, bias, add, block_bytes);
}

/* c (m, n) += a (m, k) @ b (n, k)^T, or = when !add, on `kernel`: both operands new each
 * call (a weight gradient's), row-major with the depth contiguous, rounded as they are
 * packed: a into panels in `work` (bf16_panel_size(m, k) halves), b a strip at a time. */
BF16_TARGET static void bf16_gemm_nt(int kernel, float *restrict c, ptrdiff_t ldc,
                                     const float *restrict a, ptrdiff_t lda, ptrdiff_t m,
                                     const float *restrict b, ptrdiff_t ldb, ptrdiff_t n,
                                     ptrdiff_t k, uint16_t *restrict work,
                                     ptrdiff_t block_bytes, int add)
{
    if (k == 0) {
        for (ptrdiff_t i = 0; i < m && !add; i++)
            for (ptrdiff_t j = 0; j < n; j++)
                c[i * ldc + j] = 0.0f;
        return;
    }
    bf16_pack_depth_rows((uint32_t *) work, a, lda, m, k);
    bf16_panels_times_strips(kernel, c, ldc, (const uint32_t *) work, m, k, b, ldb, 1, n, NULL,
                             add, block_bytes);
}
#else

static void bf16_panel_gemm(int kernel, float *restrict c, ptrdiff_t ldc,
                            const uint16_t *restrict panels, ptrdiff_t m, ptrdiff_t k,
                            const float *restrict b, ptrdiff_t ldb, int b_transposed,
                            ptrdiff_t n, const float *restrict bias, ptrdiff_t block_bytes,
                            int add)
{
    (void) kernel; (void) c; (void) ldc; (void) panels; (void) m; (void) k; (void) b;
    (void) ldb; (void) b_transposed; (void) n; (void) bias; (void) block_bytes; (void) add;
    __builtin_trap();   /* never called: bf16_panel_kernels() is 0 here */
}

static void bf16_gemm_nt(int kernel, float *restrict c, ptrdiff_t ldc, const float *restrict a,
                         ptrdiff_t lda, ptrdiff_t m, const float *restrict b, ptrdiff_t ldb,
                         ptrdiff_t n, ptrdiff_t k, uint16_t *restrict work,
                         ptrdiff_t block_bytes, int add)
{
    (void) kernel; (void) c; (void) ldc; (void) a; (void) lda; (void) m; (void) b; (void) ldb;
    (void) n; (void) k; (void) work; (void) block_bytes; (void) add;
    __builtin_trap();
}
#endif

/* The kernels of bf16_panel_gemm this build and CPU run, as DYNAR_BF16_* bits: AVX512_BF16,
 * and AMX besides it (the strips are filled with AVX-512); BFMMLA on aarch64. */
static inline int bf16_panel_kernels(void)
{
    if (BF16_HAVE_ARM)
        return dynar_bf16_features() & DYNAR_BF16_ARM;
    const int features = BF16_HAVE_X86 ? dynar_bf16_features() : 0;
    if (!(features & DYNAR_BF16_AVX512))
        return 0;
    return features & (DYNAR_BF16_AVX512 | (BF16_HAVE_AMX ? DYNAR_BF16_AMX : 0));
}

#endif
