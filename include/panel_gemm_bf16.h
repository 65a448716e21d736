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
 * Two kernels on those panels and strips, the caller's `kernel` (DYNAR_BF16_* of bf16.h):
 * - DYNAR_BF16_AMX, AMX tiles: TDPBF16PS adds a 16 x 32 tile of a times a 32 x 16 tile of b to
 *   a 16 x 16 float32 tile of c. A block of c is a panel x the strip's 3 tiles of columns: per
 *   16 pairs, 4 tile loads and 3 TDPBF16PS.
 * - DYNAR_BF16_AVX512, VDPBF16PS: acc[l] += a0 * b0[l] + a1 * b1[l]. A block of c is half a
 *   panel (8 rows) x 3 vectors of 16 columns, 24 accumulators: per pair, 3 loads of the strip,
 *   8 broadcast units of the panel, 24 VDPBF16PS.
 * Both sum each element's pairs in depth order across passes, so the passes (block_bytes)
 * never change a result; the two kernels differ from each other in summation order only.
 *
 * Rounding: the strip's conversion (VCVTNE2PS2BF16) is nearest-even with subnormals to zero
 * and NaN kept quiet, which is include/bf16.h's rule, the one the panels are packed with; the
 * tests hold the two to each other. The kernels are compiled for their instructions whatever
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

/* Panels [p0, p1) of a (m, k), element (i, j) at a[i * row_stride + j * col_stride], rounded
 * to bf16, with the zero padding. */
static void bf16_panel_pack(uint16_t *restrict panels, const float *restrict a, ptrdiff_t m,
                            ptrdiff_t k, ptrdiff_t row_stride, ptrdiff_t col_stride,
                            ptrdiff_t p0, ptrdiff_t p1)
{
    const ptrdiff_t depth = 2 * bf16_panel_pairs(k);
    for (ptrdiff_t i = p0 * BF16_PANEL_ROWS; i < p1 * BF16_PANEL_ROWS; i++)
        for (ptrdiff_t j = 0; j < depth; j++)
            panels[bf16_panel_offset(i, j, k)] = i < m && j < k
                ? dynar_bf16_from_float(a[i * row_stride + j * col_stride]) : 0;
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
                for (int v = 0; v < nv; v++)
                    for (ptrdiff_t t = 0; t < kd; t += 16)
                        bf16_units_transposed(strip + t * BF16_PANEL_WIDTH + v * 16,
                                              BF16_PANEL_WIDTH, b + (j0 + v * 16) * ldb, ldb,
                                              v < nv - 1 ? 16 : tail, 16, k, 2 * (t0 + t),
                                              16);
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
    /* A panel block's rows are each row's 16 pairs as they lie, rounded in one register. */
    const ptrdiff_t panel_pairs = bf16_panel_pairs(k);
    uint32_t *units = (uint32_t *) work;
    for (ptrdiff_t i = 0; i < bf16_panel_count(m) * BF16_PANEL_ROWS; i++)
        for (ptrdiff_t t = 0; t < panel_pairs; t += BF16_BLOCK_PAIRS) {
            const float *row = a + i * lda + 2 * t;
            const ptrdiff_t left = i < m ? k - 2 * t : 0;
            const __m512 lo = _mm512_maskz_loadu_ps(bf16_lanes(left), row);
            const __m512 hi = _mm512_maskz_loadu_ps(bf16_lanes(left - 16), row + 16);
            _mm512_storeu_si512(units + bf16_panel_unit(i, t, k),
                                (__m512i) _mm512_cvtne2ps_pbh(hi, lo));
        }
    bf16_panels_times_strips(kernel, c, ldc, units, m, k, b, ldb, 1, n, NULL, add,
                             block_bytes);
}
#else
#define BF16_HAVE_X86 0
#define BF16_HAVE_AMX 0

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
 * and AMX besides it (the strips are filled with AVX-512). */
static inline int bf16_panel_kernels(void)
{
    const int features = BF16_HAVE_X86 ? dynar_bf16_features() : 0;
    if (!(features & DYNAR_BF16_AVX512))
        return 0;
    return features & (DYNAR_BF16_AVX512 | (BF16_HAVE_AMX ? DYNAR_BF16_AMX : 0));
}

#endif
