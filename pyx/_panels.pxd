# A layer's weights as the left operand of its GEMMs: on dynar's panel GEMM
# (include/panel_gemm.h), packed once per call, or on BLAS, which packs them every call.
#
# Whether a call uses the panels is conv.set_panel_gemm's switch (default
# PANEL_GEMM_PREFERRED), which the call's plan reads as ConvCall.panel_block: the bytes of L1
# a panel's block may fill (conv.panel_block_bytes), 0 for BLAS. The kernel reserves
# workspace for the panels when it is on and describes each operand with weights_operand:
# w (rows, cols) row-major, or its transpose. Without panels (NULL) the products run on BLAS
# with w itself, so one call site serves both. In bf16 (ConvCall.bf16: --precision bf16 on a
# CPU with AVX512_BF16, AMX or aarch64's BFMMLA) the panels are bf16
# (include/panel_gemm_bf16.h) and the products read the other operand rounded to bf16,
# summing in float32.
from cython cimport floating
from libc.stdint cimport uint16_t

from _blas cimport gemm

cdef extern from "panel_gemm.h" nogil:
    enum:
        PANEL_GEMM_PREFERRED
        PANEL_ROWS
        PANEL_VECTORS
        PANEL_VECTOR_BYTES
    Py_ssize_t panel_size(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t panel_count(Py_ssize_t m)
    Py_ssize_t panel_offset(Py_ssize_t i, Py_ssize_t j, Py_ssize_t k)
    void panel_zero_padding_f(float* panels, Py_ssize_t m, Py_ssize_t k)
    void panel_zero_padding_d(double* panels, Py_ssize_t m, Py_ssize_t k)
    void panel_pack_f(float* panels, const float* a, Py_ssize_t m, Py_ssize_t k,
                      Py_ssize_t row_stride, Py_ssize_t col_stride, Py_ssize_t p0,
                      Py_ssize_t p1)
    void panel_pack_d(double* panels, const double* a, Py_ssize_t m, Py_ssize_t k,
                      Py_ssize_t row_stride, Py_ssize_t col_stride, Py_ssize_t p0,
                      Py_ssize_t p1)
    void panel_gemm_f(float* c, Py_ssize_t ldc, const float* panels, Py_ssize_t m,
                      Py_ssize_t k, const float* b, Py_ssize_t ldb, bint b_transposed,
                      Py_ssize_t n, const float* bias, Py_ssize_t block_bytes)
    void panel_gemm_d(double* c, Py_ssize_t ldc, const double* panels, Py_ssize_t m,
                      Py_ssize_t k, const double* b, Py_ssize_t ldb, bint b_transposed,
                      Py_ssize_t n, const double* bias, Py_ssize_t block_bytes)

cdef extern from "panel_gemm_bf16.h" nogil:
    enum:
        BF16_PANEL_ROWS
        BF16_BLOCK_PAIRS   # pairs of depth in a block, a row's halves adjacent within it
    Py_ssize_t bf16_panel_size(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t bf16_panel_count(Py_ssize_t m)
    Py_ssize_t bf16_panel_offset(Py_ssize_t i, Py_ssize_t j, Py_ssize_t k)
    void bf16_panel_zero_padding(uint16_t* panels, Py_ssize_t m, Py_ssize_t k)
    void bf16_panel_pack(uint16_t* panels, const float* a, Py_ssize_t m, Py_ssize_t k,
                         Py_ssize_t row_stride, Py_ssize_t col_stride, Py_ssize_t p0,
                         Py_ssize_t p1)
    void bf16_panel_pack_taps(uint16_t* panels, Py_ssize_t tap_stride, const float* a,
                              Py_ssize_t m, Py_ssize_t k, Py_ssize_t row_stride,
                              Py_ssize_t col_stride, int taps, Py_ssize_t p0, Py_ssize_t p1)
    void bf16_panel_gemm(int kernel, float* c, Py_ssize_t ldc, const uint16_t* panels,
                         Py_ssize_t m, Py_ssize_t k, const float* b, Py_ssize_t ldb,
                         bint b_transposed, Py_ssize_t n, const float* bias,
                         Py_ssize_t block_bytes, bint add)
    void bf16_gemm_nt(int kernel, float* c, Py_ssize_t ldc, const float* a, Py_ssize_t lda,
                      Py_ssize_t m, const float* b, Py_ssize_t ldb, Py_ssize_t n, Py_ssize_t k,
                      uint16_t* work, Py_ssize_t block_bytes, bint add)
    int bf16_panel_kernels()


cdef struct Weights:
    void* panels         # the operand packed, or NULL: BLAS multiplies by w itself
    Py_ssize_t m, k      # the operand's shape: (rows, cols) of w, or (cols, rows) transposed
    bint transposed
    Py_ssize_t block_bytes   # of L1, for a panel's part of one pass (the plan's panel_block)
    int bf16                 # bf16 panels on this kernel (DYNAR_BF16_*), 0: float32


cdef inline Weights weights_operand(Py_ssize_t rows, Py_ssize_t cols, bint transposed,
                                    void* panels, Py_ssize_t block_bytes,
                                    int bf16) noexcept nogil:
    """w (rows, cols), or its transpose, as a left operand; panels NULL for BLAS; bf16:
    the call's bf16 kernel (ConvCall.bf16), 0 for float32."""
    cdef Weights a
    a.panels = panels
    a.bf16 = bf16 if panels != NULL else 0
    a.block_bytes = block_bytes
    a.m = cols if transposed else rows
    a.k = rows if transposed else cols
    a.transposed = transposed
    return a


cdef inline Py_ssize_t panels_to_pack(const Weights* a) noexcept nogil:
    """How many pack_panel calls pack a: 0 on BLAS."""
    if a.panels == NULL:
        return 0
    return bf16_panel_count(a.m) if a.bf16 else panel_count(a.m)



cdef inline void pack_panel(const Weights* a, const floating* w, Py_ssize_t p) noexcept nogil:
    """Packs panel p of a from w, so threads can split the panels."""
    cdef Py_ssize_t rs = 1 if a.transposed else a.k
    cdef Py_ssize_t cs = a.m if a.transposed else 1
    if floating is float and a.bf16:
        bf16_panel_pack(<uint16_t*> a.panels, w, a.m, a.k, rs, cs, p, p + 1)
    elif floating is float:
        panel_pack_f(<float*> a.panels, w, a.m, a.k, rs, cs, p, p + 1)
    else:
        panel_pack_d(<double*> a.panels, w, a.m, a.k, rs, cs, p, p + 1)


cdef inline void times_weights(floating* c, Py_ssize_t ldc, const Weights* a,
                               const floating* w, const floating* b, Py_ssize_t ldb,
                               Py_ssize_t n, const floating* bias) noexcept nogil:
    """c (m, n) = a (m, k) @ b (k, n) [+ bias (m,) on every column], on the calling thread;
    w is the array a describes."""
    cdef Py_ssize_t i, j
    cdef floating beta = 0
    if a.panels != NULL:
        if floating is float and a.bf16:
            bf16_panel_gemm(a.bf16, c, ldc, <const uint16_t*> a.panels, a.m, a.k, b, ldb,
                            False, n, bias, a.block_bytes, False)
        elif floating is float:
            panel_gemm_f(c, ldc, <const float*> a.panels, a.m, a.k, b, ldb, False, n, bias,
                         a.block_bytes)
        else:
            panel_gemm_d(c, ldc, <const double*> a.panels, a.m, a.k, b, ldb, False, n, bias,
                         a.block_bytes)
        return
    if bias != NULL:
        beta = 1
        for i in range(a.m):
            for j in range(n):
                c[i * ldc + j] = bias[i]
    gemm(a.transposed, False, <int> a.m, <int> n, <int> a.k, <floating> 1, w,
         <int> (a.m if a.transposed else a.k), b, <int> ldb, beta, c, <int> ldc)
