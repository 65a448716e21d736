# Row-major GEMM over scipy's BLAS (scipy.linalg.cython_blas), for float and double.
#
# BLAS is column-major; a row-major C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T,
# so the operands are swapped and the transposes kept. Dimensions are BLAS ints (32-bit):
# callers validate that every GEMM dimension fits (see _validate.pxd: check_blas_dim).
from cython cimport floating
from scipy.linalg.cython_blas cimport sgemm, dgemm


cdef inline void gemm(bint trans_a, bint trans_b, int m, int n, int k,
                      floating alpha, const floating* a, int lda,
                      const floating* b, int ldb,
                      floating beta, floating* c, int ldc) noexcept nogil:
    """c (m, n) = alpha * op(a) (m, k) @ op(b) (k, n) + beta * c, all row-major."""
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    if m <= 0 or n <= 0:
        return
    if floating is float:
        sgemm(&tb, &ta, &n, &m, &k, &alpha, <float*> b, &ldb, <float*> a, &lda, &beta, c, &ldc)
    else:
        dgemm(&tb, &ta, &n, &m, &k, &alpha, <double*> b, &ldb, <double*> a, &lda, &beta, c, &ldc)
