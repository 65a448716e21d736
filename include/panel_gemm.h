/* dynar's own GEMM for products whose left operand is reused call after call: the weights of
 * a convolution, the same for every image of a batch (pyx/im2col.pyx, pyx/winograd.pyx), or a
 * fully connected layer's batch, the same for every block of its output (pyx/linear.pyx).
 *
 *     c (m, n) = a (m, k) @ op(b) (k, n)  [+ bias[i] on every column of row i], row-major,
 *
 * with `a` packed once into row panels (panel_pack, or written in panel form by its producer),
 * where a BLAS GEMM packs both operands on every call: the weights are packed once per batch
 * instead of once per image. op(b) is b, or b^T for a fully connected layer's weights.
 *
 * Panels: PANEL_ROWS rows of `a` at a time, stored column by column, so the micro-kernel reads
 * one contiguous run per column: a[p * PANEL_ROWS + r][j] is
 * panels[(p * k + j) * PANEL_ROWS + r], with rows past m zero (their products are never
 * stored, but garbage there could be subnormal, which x86 multiply-adds take microcode assists
 * for). The micro-kernel keeps a PANEL_ROWS x PANEL_VECTORS block of c in vector registers,
 * and for every j multiplies one broadcast element of the panel with PANEL_VECTORS vectors of
 * row j of b, loaded once. The block fills the register file but for the vectors of b and the
 * broadcast: with AVX-512 (32 registers of 16 floats) 8 x 3 vectors, 24 accumulators; with
 * AVX2 (16 registers) 6 x 2, 12 accumulators, 2 loads of b and 6 broadcasts per 12
 * multiply-adds (a 4 x 3 block there leaves no register for b, and the compiler reloads each
 * vector of b for every row: 16 loads per 12 multiply-adds, load-bound at 0.75x).
 *
 * The depth goes in passes: a panel's part of a pass fills at most `block_bytes`, half the
 * core's L1 data cache (the caller reads its size from the OS: conv.panel_block_bytes). Within
 * a pass, b is copied a strip of PANEL_VECTORS vectors wide at a time into a contiguous buffer
 * on the stack, which every panel then sweeps: rows of b read in place lie a row stride apart,
 * a cache line or two each, and reading them again for every panel costs 10-25% against
 * reading the strip (docs/notes/2026-12-05-avx2-panel-gemm.md). Columns
 * past the last whole strip are read in place. A transposed b (a fully connected layer's
 * weights, rows of depth) is transposed into every strip, the last one zero-padded. */
#ifndef DYNAR_PANEL_GEMM_H
#define DYNAR_PANEL_GEMM_H
#include <stddef.h>

/* Bytes of one vector register, and the register block: accumulators plus the vectors of b
 * and the broadcast must fit in the register file (32 registers with AVX-512 and on aarch64,
 * 16 otherwise). */
#if defined(__AVX512F__)
#define PANEL_VECTOR_BYTES 64
#elif defined(__AVX__)
#define PANEL_VECTOR_BYTES 32
#else
#define PANEL_VECTOR_BYTES 16
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define PANEL_ROWS 8
#define PANEL_VECTORS 3    /* panel_narrow_block dispatches 1 to 3 */
#else
#define PANEL_ROWS 6
#define PANEL_VECTORS 2
#endif
/* The shortest pass over c, whatever the cache: shorter ones spend more on storing c. */
#define PANEL_MIN_DEPTH 64
/* The stack buffer a pass's strip of b is copied to; it bounds the depth of a pass too. */
#define PANEL_STRIP_BYTES (64 * 1024)

/* Whether im2col and Winograd use these kernels by default (conv.set_panel_gemm overrides):
 * where the build targets AVX2 or AVX-512, where they were measured faster than OpenBLAS on
 * every layer they run (AVX-512: docs/notes/2026-12-02-kernels.md, "The panel GEMM"; AVX2:
 * docs/notes/2026-12-05-avx2-panel-gemm.md). Not yet measured on aarch64, and a portable
 * build's 16-byte vectors would lose. */
#if defined(__AVX2__)
#define PANEL_GEMM_PREFERRED 1
#else
#define PANEL_GEMM_PREFERRED 0
#endif

#define PANEL_INLINE static inline __attribute__((always_inline))

/* Elements of the packed form of an m x k operand. */
static inline ptrdiff_t panel_size(ptrdiff_t m, ptrdiff_t k)
{
    return (m + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS * k;
}

static inline ptrdiff_t panel_count(ptrdiff_t m)
{
    return (m + PANEL_ROWS - 1) / PANEL_ROWS;
}

/* Where element (i, j) of an operand with k columns lives in its panels: for kernels that
 * compute the operand straight into panel form (Winograd's transformed weights). */
static inline ptrdiff_t panel_offset(ptrdiff_t i, ptrdiff_t j, ptrdiff_t k)
{
    return ((i / PANEL_ROWS) * k + j) * PANEL_ROWS + i % PANEL_ROWS;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* dst's rows 0..15 (a row stride of ldd) = columns 0..15 of src's 16 x 16 block: pairs,
 * then quads, then 4- and 8-float halves swapped in three rounds of shuffles. */
static inline void panel_transpose16(float *restrict dst, ptrdiff_t ldd,
                                     const float *restrict src, ptrdiff_t lds)
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = (__m512) _mm512_unpacklo_pd((__m512d) t[i], (__m512d) t[i + 2]);
        r[i + 1] = (__m512) _mm512_unpackhi_pd((__m512d) t[i], (__m512d) t[i + 2]);
        r[i + 2] = (__m512) _mm512_unpacklo_pd((__m512d) t[i + 1], (__m512d) t[i + 3]);
        r[i + 3] = (__m512) _mm512_unpackhi_pd((__m512d) t[i + 1], (__m512d) t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int q = 0; q < 4; q++) {
            t[i + q] = _mm512_shuffle_f32x4(r[i + q], r[i + q + 4], 0x88);
            t[i + q + 4] = _mm512_shuffle_f32x4(r[i + q], r[i + q + 4], 0xdd);
        }
    for (int q = 0; q < 8; q++) {
        r[q] = _mm512_shuffle_f32x4(t[q], t[q + 8], 0x88);
        r[q + 8] = _mm512_shuffle_f32x4(t[q], t[q + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++)
        _mm512_storeu_ps(dst + i * ldd, r[i]);
}
#define PANEL_TRANSPOSE16 1
/* Only reached for float: the double instantiation's branch is dead (8 lanes). */
#define PANEL_TRANSPOSE16_CALL(dst, ldd, src, lds) \
    panel_transpose16((float *) (dst), ldd, (const float *) (src), lds)
#else
#define PANEL_TRANSPOSE16 0
#define PANEL_TRANSPOSE16_CALL(dst, ldd, src, lds) ((void) 0)
#endif

#define DYNAR_PANEL_GEMM(REAL, SUFFIX)                                                       \
typedef REAL panel_vec_##SUFFIX __attribute__((vector_size(PANEL_VECTOR_BYTES)));            \
typedef REAL panel_mem_##SUFFIX                                                              \
    __attribute__((vector_size(PANEL_VECTOR_BYTES), aligned(sizeof(REAL))));                 \
                                                                                             \
/* Panels [p0, p1) of a (m, k), element (i, j) at a[i * row_stride + j * col_stride]: a     \
 * strided view, so w and its transpose pack from the same array. */                        \
static void panel_pack_##SUFFIX(REAL *restrict panels, const REAL *restrict a, ptrdiff_t m,  \
                                ptrdiff_t k, ptrdiff_t row_stride, ptrdiff_t col_stride,     \
                                ptrdiff_t p0, ptrdiff_t p1)                                  \
{                                                                                            \
    for (ptrdiff_t p = p0; p < p1; p++) {                                                    \
        REAL *dst = panels + p * k * PANEL_ROWS;                                             \
        const ptrdiff_t i0 = p * PANEL_ROWS;                                                 \
        const ptrdiff_t rows = m - i0 < PANEL_ROWS ? m - i0 : PANEL_ROWS;                    \
        for (ptrdiff_t j = 0; j < k; j++, dst += PANEL_ROWS) {                               \
            for (ptrdiff_t r = 0; r < rows; r++)                                             \
                dst[r] = a[(i0 + r) * row_stride + j * col_stride];                          \
            for (ptrdiff_t r = rows; r < PANEL_ROWS; r++)                                    \
                dst[r] = 0;                                                                  \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Zeroes the rows past m of the last panel, which panel_offset never addresses. */          \
static void panel_zero_padding_##SUFFIX(REAL *restrict panels, ptrdiff_t m, ptrdiff_t k)      \
{                                                                                            \
    const ptrdiff_t rows = m - (panel_count(m) - 1) * PANEL_ROWS;                            \
    REAL *last = panels + (panel_count(m) - 1) * k * PANEL_ROWS;                             \
    if (m == 0 || rows == PANEL_ROWS)                                                        \
        return;                                                                              \
    for (ptrdiff_t j = 0; j < k; j++)                                                        \
        for (ptrdiff_t r = rows; r < PANEL_ROWS; r++)                                        \
            last[j * PANEL_ROWS + r] = 0;                                                    \
}                                                                                            \
                                                                                             \
/* One block of c: rows [0, rows) of a panel x nv vectors of columns, the last with `tail`   \
 * valid lanes, over depth kd. first: start from bias (or zero), else add to c. rows, nv     \
 * and tail are constants at the full-block call, so that case compiles without tests. */   \
PANEL_INLINE void panel_block_##SUFFIX(REAL *restrict c, ptrdiff_t ldc,                      \
                                       const REAL *restrict panel, ptrdiff_t kd,             \
                                       const REAL *restrict b, ptrdiff_t ldb,                \
                                       const REAL *restrict bias, int first, int rows,       \
                                       int nv, int tail)                                     \
{                                                                                            \
    typedef panel_vec_##SUFFIX vec;                                                          \
    typedef panel_mem_##SUFFIX mem;                                                          \
    enum { LANES = PANEL_VECTOR_BYTES / sizeof(REAL) };                                      \
    vec acc[PANEL_ROWS][PANEL_VECTORS];                                                      \
    for (int r = 0; r < PANEL_ROWS; r++)                                                     \
        for (int v = 0; v < nv; v++) {                                                       \
            if (!first && r < rows && (v < nv - 1 || tail == LANES))                         \
                acc[r][v] = *(const mem *)(c + r * ldc + v * LANES);                         \
            else if (!first && r < rows) {                                                   \
                acc[r][v] = (vec){0};                                                        \
                for (int l = 0; l < tail; l++)                                               \
                    acc[r][v][l] = c[r * ldc + v * LANES + l];                               \
            } else                                                                           \
                acc[r][v] = (vec){0} + (bias && r < rows ? bias[r] : (REAL)0);               \
        }                                                                                    \
    for (ptrdiff_t j = 0; j < kd; j++) {                                                     \
        const REAL *bj = b + j * ldb;                                                        \
        vec bv[PANEL_VECTORS];                                                               \
        for (int v = 0; v < nv; v++) {                                                       \
            if (v < nv - 1 || tail == LANES)                                                 \
                bv[v] = *(const mem *)(bj + v * LANES);                                      \
            else {                                                                           \
                bv[v] = (vec){0};                                                            \
                for (int l = 0; l < tail; l++)                                               \
                    bv[v][l] = bj[v * LANES + l];                                            \
            }                                                                                \
        }                                                                                    \
        const REAL *aj = panel + j * PANEL_ROWS;                                             \
        for (int r = 0; r < PANEL_ROWS; r++)                                                 \
            for (int v = 0; v < nv; v++)                                                     \
                acc[r][v] += aj[r] * bv[v];                                                  \
    }                                                                                        \
    for (int r = 0; r < rows; r++)                                                           \
        for (int v = 0; v < nv; v++) {                                                       \
            if (v < nv - 1 || tail == LANES)                                                 \
                *(mem *)(c + r * ldc + v * LANES) = acc[r][v];                               \
            else                                                                             \
                for (int l = 0; l < tail; l++)                                               \
                    c[r * ldc + v * LANES + l] = acc[r][v][l];                               \
        }                                                                                    \
}                                                                                            \
                                                                                             \
/* A block of nv (1 to PANEL_VECTORS) vectors, nv as a constant. */                          \
PANEL_INLINE void panel_narrow_block_##SUFFIX(REAL *restrict c, ptrdiff_t ldc,                \
                                              const REAL *restrict panel, ptrdiff_t kd,       \
                                              const REAL *restrict b, ptrdiff_t ldb,          \
                                              const REAL *restrict bias, int first, int rows, \
                                              int nv, int tail)                               \
{                                                                                            \
    if (nv == 1)                                                                             \
        panel_block_##SUFFIX(c, ldc, panel, kd, b, ldb, bias, first, rows, 1, tail);         \
    else if (nv == 2)                                                                        \
        panel_block_##SUFFIX(c, ldc, panel, kd, b, ldb, bias, first, rows, 2, tail);         \
    else                                                                                     \
        panel_block_##SUFFIX(c, ldc, panel, kd, b, ldb, bias, first, rows, PANEL_VECTORS,    \
                             tail);                                                          \
}                                                                                            \
                                                                                             \
/* A pass's strip when op(b) = b^T, b holding n rows of depth k (a fully connected layer's   \
 * weights): rows [0, cols) of b (from the strip's first column and the pass's first depth)  \
 * written as kd rows of WIDTH columns, the columns past cols zero. Whole strips go by       \
 * 16 x 16 float transposes where AVX-512 has them, the rest element by element. */        \
static void panel_strip_transposed_##SUFFIX(REAL *restrict strip, const REAL *restrict b,     \
                                            ptrdiff_t ldb, ptrdiff_t kd, ptrdiff_t cols)     \
{                                                                                            \
    enum { LANES = PANEL_VECTOR_BYTES / sizeof(REAL), WIDTH = PANEL_VECTORS * LANES };      \
    ptrdiff_t done = 0;                                                                      \
    if (PANEL_TRANSPOSE16 && LANES == 16 && cols == WIDTH) {                                 \
        done = kd / 16 * 16;                                                                 \
        for (ptrdiff_t j = 0; j < done; j += 16)                                             \
            for (int v = 0; v < PANEL_VECTORS; v++)                                          \
                PANEL_TRANSPOSE16_CALL(strip + j * WIDTH + v * 16, WIDTH,                    \
                                       b + v * 16 * ldb + j, ldb);                           \
    }                                                                                        \
    for (ptrdiff_t col = 0; col < WIDTH; col++)                                              \
        for (ptrdiff_t j = done; j < kd; j++)                                                \
            strip[j * WIDTH + col] = col < cols ? b[col * ldb + j] : (REAL) 0;               \
}                                                                                            \
                                                                                             \
/* c (m, n) = a (m, k) @ op(b) (k, n) [+ bias (m,) on every column], row-major; op(b) is b,  \
 * or b^T (b then n x k) when b_transposed; a packed by panel_pack; a panel's part of one    \
 * pass over c fills at most block_bytes. k == 0 leaves c = bias (or zero). */               \
static void panel_gemm_##SUFFIX(REAL *restrict c, ptrdiff_t ldc, const REAL *restrict panels, \
                                ptrdiff_t m, ptrdiff_t k, const REAL *restrict b,            \
                                ptrdiff_t ldb, int b_transposed, ptrdiff_t n,                \
                                const REAL *restrict bias, ptrdiff_t block_bytes)            \
{                                                                                            \
    if (k == 0) {                                                                            \
        for (ptrdiff_t i = 0; i < m; i++)                                                    \
            for (ptrdiff_t j = 0; j < n; j++)                                                \
                c[i * ldc + j] = bias ? bias[i] : (REAL)0;                                   \
        return;                                                                              \
    }                                                                                        \
    enum { LANES = PANEL_VECTOR_BYTES / sizeof(REAL), WIDTH = PANEL_VECTORS * LANES };      \
    typedef panel_mem_##SUFFIX mem;                                                          \
    ptrdiff_t max_depth = block_bytes / (ptrdiff_t) (PANEL_ROWS * sizeof(REAL));             \
    if (max_depth > PANEL_STRIP_BYTES / (ptrdiff_t) (WIDTH * sizeof(REAL)))                  \
        max_depth = PANEL_STRIP_BYTES / (ptrdiff_t) (WIDTH * sizeof(REAL));                  \
    if (max_depth < PANEL_MIN_DEPTH)                                                         \
        max_depth = PANEL_MIN_DEPTH;                                                         \
    const ptrdiff_t passes = (k + max_depth - 1) / max_depth;                                \
    const ptrdiff_t depth = (k + passes - 1) / passes;                                       \
    REAL strip[depth * WIDTH] __attribute__((aligned(PANEL_VECTOR_BYTES)));                  \
    const ptrdiff_t tail_columns = n % WIDTH;                                                \
    const int tail_vectors = (int) ((tail_columns + LANES - 1) / LANES);                     \
    const int tail_lanes = (int) (tail_columns - (tail_vectors - 1) * LANES);                \
    for (ptrdiff_t k0 = 0; k0 < k; k0 += depth) {                                            \
        const ptrdiff_t kd = k - k0 < depth ? k - k0 : depth;                                \
        for (ptrdiff_t j0 = 0; j0 < n; j0 += WIDTH) {                                        \
            const int whole = n - j0 >= WIDTH;                                               \
            const REAL *bs = strip;                                                          \
            ptrdiff_t lds = WIDTH;                                                           \
            if (b_transposed) {                                                              \
                panel_strip_transposed_##SUFFIX(strip, b + j0 * ldb + k0, ldb, kd,           \
                                                whole ? WIDTH : n - j0);                     \
            } else if (!whole) {            /* the last columns, read in place */            \
                bs = b + k0 * ldb + j0;                                                      \
                lds = ldb;                                                                   \
            } else {                                                                         \
                const REAL *rows_of_b = b + k0 * ldb + j0;                                   \
                for (ptrdiff_t j = 0; j < kd; j++)                                           \
                    for (int v = 0; v < PANEL_VECTORS; v++)                                  \
                        *(mem *)(strip + j * WIDTH + v * LANES) =                            \
                            *(const mem *)(rows_of_b + j * ldb + v * LANES);                 \
            }                                                                                \
            for (ptrdiff_t p = 0; p < panel_count(m); p++) {                                 \
                const ptrdiff_t i0 = p * PANEL_ROWS;                                         \
                const int rows = m - i0 < PANEL_ROWS ? (int) (m - i0) : PANEL_ROWS;          \
                const REAL *panel = panels + (p * k + k0) * PANEL_ROWS;                      \
                REAL *cb = c + i0 * ldc + j0;                                                \
                const REAL *pbias = bias ? bias + i0 : NULL;                                 \
                if (whole && rows == PANEL_ROWS)                                             \
                    panel_block_##SUFFIX(cb, ldc, panel, kd, bs, lds, pbias, k0 == 0,        \
                                         PANEL_ROWS, PANEL_VECTORS, LANES);                  \
                else if (whole)                                                              \
                    panel_block_##SUFFIX(cb, ldc, panel, kd, bs, lds, pbias, k0 == 0,        \
                                         rows, PANEL_VECTORS, LANES);                        \
                else                                                                         \
                    panel_narrow_block_##SUFFIX(cb, ldc, panel, kd, bs, lds, pbias, k0 == 0, \
                                                rows, tail_vectors, tail_lanes);             \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

DYNAR_PANEL_GEMM(float, f)
DYNAR_PANEL_GEMM(double, d)

#endif
