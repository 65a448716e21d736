/* The portable kernel of kernels.bf16.matmul (pyx/bf16.pyx), a GEMM on bf16 operands with
 * float32 sums that any CPU runs:
 *
 *     c (m, n) = a (m, k) @ b (k, n)   [+ c],  row-major c,
 *
 * a and b given as float32 at any strides and rounded to bf16 (include/bf16.h) as they are
 * packed, so the caller needs no rounded copy of either. matmul's other kernels (AMX,
 * AVX512_BF16, BFMMLA) are the bf16 panel GEMM's (include/panel_gemm_bf16.h); this one is
 * the reference the tests hold them to on every CPU, no faster than float32 BLAS.
 *
 * Packed form: the operand's rows in panels of BF16_PANEL (8) rows; within a panel, the depth
 * in quads of 4, and a quad as 4 row pairs of 8 halves: row 2p's 4 values, then row 2p+1's.
 * b is packed the same way as b^T (its columns are the "rows"), so one packer serves both.
 * Rows past the operand's and depth past k are zero, so every tile runs whole quads. */
#ifndef DYNAR_BF16_GEMM_H
#define DYNAR_BF16_GEMM_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "panel_gemm_bf16.h"

#define BF16_PANEL 8                       /* rows of a panel, columns of a tile */
#define BF16_QUAD 4                        /* depth of a packed unit */
#define BF16_QUAD_HALVES (BF16_PANEL * BF16_QUAD)
/* Quads of one pass over a tile: a's and b's panels for a pass (2 x 16 KB) stay in L1 while
 * the pass sweeps c's tiles. */
#define BF16_PASS_QUADS 256

/* The kernels of kernels.bf16.matmul: portable tiles on this header's layout, or the bf16
 * panel GEMM's (include/panel_gemm_bf16.h) on its panels and strips. */
enum { BF16_KERNEL_PORTABLE = 0, BF16_KERNEL_BFMMLA = 1, BF16_KERNEL_AVX512 = 2,
       BF16_KERNEL_AMX = 3 };

static inline ptrdiff_t bf16_quads(ptrdiff_t k) { return (k + BF16_QUAD - 1) / BF16_QUAD; }
static inline ptrdiff_t bf16_panels(ptrdiff_t m) { return (m + BF16_PANEL - 1) / BF16_PANEL; }

/* Halves of the packed form of an operand with m rows and depth k. */
static inline ptrdiff_t bf16_packed_size(ptrdiff_t m, ptrdiff_t k)
{
    return bf16_panels(m) * bf16_quads(k) * BF16_QUAD_HALVES;
}

/* Panels [p0, p1) of x (m rows, depth k), element (i, j) at x[i * row_stride + j *
 * depth_stride], rounded to bf16 into packed. */
static void bf16_pack(uint16_t *restrict packed, const float *restrict x, ptrdiff_t m,
                      ptrdiff_t k, ptrdiff_t row_stride, ptrdiff_t depth_stride, ptrdiff_t p0,
                      ptrdiff_t p1)
{
    const ptrdiff_t quads = bf16_quads(k);
    for (ptrdiff_t p = p0; p < p1; p++) {
        uint16_t *dst = packed + p * quads * BF16_QUAD_HALVES;
        for (ptrdiff_t q = 0; q < quads; q++, dst += BF16_QUAD_HALVES)
            for (int r = 0; r < BF16_PANEL; r++) {
                const ptrdiff_t i = p * BF16_PANEL + r;
                uint16_t *quad_row = dst + (r / 2) * 2 * BF16_QUAD + (r % 2) * BF16_QUAD;
                for (int t = 0; t < BF16_QUAD; t++) {
                    const ptrdiff_t j = q * BF16_QUAD + t;
                    quad_row[t] = i < m && j < k
                        ? dynar_bf16_from_float(x[i * row_stride + j * depth_stride]) : 0;
                }
            }
    }
}

/* Stores (or adds, when add) rows [0, rows) x columns [0, cols) of an 8 x 8 tile t. */
static inline void bf16_store_tile(float *restrict c, ptrdiff_t ldc,
                                   float t[BF16_PANEL][BF16_PANEL], int rows, int cols,
                                   int add)
{
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            c[r * ldc + j] = add ? c[r * ldc + j] + t[r][j] : t[r][j];
}

/* The tile of c a's panel and b's panel give over `quads` quads, stored or added. */
static void bf16_tile_portable(float *restrict c, ptrdiff_t ldc, const uint16_t *restrict a,
                               const uint16_t *restrict b, ptrdiff_t quads, int rows,
                               int cols, int add)
{
    float t[BF16_PANEL][BF16_PANEL] = {{0}};
    for (ptrdiff_t q = 0; q < quads; q++, a += BF16_QUAD_HALVES, b += BF16_QUAD_HALVES)
        for (int r = 0; r < BF16_PANEL; r++)
            for (int j = 0; j < BF16_PANEL; j++) {
                const uint16_t *ar = a + (r / 2) * 2 * BF16_QUAD + (r % 2) * BF16_QUAD;
                const uint16_t *bj = b + (j / 2) * 2 * BF16_QUAD + (j % 2) * BF16_QUAD;
                for (int s = 0; s < BF16_QUAD; s++)
                    t[r][j] += dynar_bf16_to_float(ar[s]) * dynar_bf16_to_float(bj[s]);
            }
    bf16_store_tile(c, ldc, t, rows, cols, add);
}

/* Whether `kernel` is built in and this CPU may run it. */
static inline int bf16_kernel_runs(int kernel)
{
    if (kernel == BF16_KERNEL_PORTABLE)
        return 1;
    if (kernel == BF16_KERNEL_AVX512)
        return (bf16_panel_kernels() & DYNAR_BF16_AVX512) != 0;
    if (kernel == BF16_KERNEL_AMX)
        return (bf16_panel_kernels() & DYNAR_BF16_AMX) != 0;
    return kernel == BF16_KERNEL_BFMMLA && (bf16_panel_kernels() & DYNAR_BF16_ARM) != 0;
}

/* Row panel p of c (m, n) against every column panel in [q0, q1), from a packed (m, k) and
 * b packed as (n, k), on the portable tile kernel: the depth in passes of BF16_PASS_QUADS,
 * each sweeping the tiles with a's part of the pass kept in L1. add: add to c, else
 * overwrite it. */
static void bf16_gemm_panel(float *restrict c, ptrdiff_t ldc, const uint16_t *restrict a,
                            const uint16_t *restrict b, ptrdiff_t m, ptrdiff_t n, ptrdiff_t k,
                            ptrdiff_t p, ptrdiff_t q0, ptrdiff_t q1, int add)
{
    const ptrdiff_t quads = bf16_quads(k);
    const int rows = (int) (m - p * BF16_PANEL < BF16_PANEL ? m - p * BF16_PANEL : BF16_PANEL);
    const uint16_t *panel = a + p * quads * BF16_QUAD_HALVES;
    float *c_rows = c + p * BF16_PANEL * ldc;
    if (quads == 0) {
        for (int r = 0; r < rows && !add; r++)
            for (ptrdiff_t j = q0 * BF16_PANEL; j < n && j < q1 * BF16_PANEL; j++)
                c_rows[r * ldc + j] = 0;
        return;
    }
    for (ptrdiff_t k0 = 0; k0 < quads; k0 += BF16_PASS_QUADS) {
        const ptrdiff_t kq = quads - k0 < BF16_PASS_QUADS ? quads - k0 : BF16_PASS_QUADS;
        for (ptrdiff_t q = q0; q < q1; q++) {
            const int cols = (int) (n - q * BF16_PANEL < BF16_PANEL ? n - q * BF16_PANEL
                                                                    : BF16_PANEL);
            bf16_tile_portable(c_rows + q * BF16_PANEL, ldc, panel + k0 * BF16_QUAD_HALVES,
                               b + (q * quads + k0) * BF16_QUAD_HALVES, kq, rows, cols,
                               add || k0 > 0);
        }
    }
}

#endif
