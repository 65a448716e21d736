"""Fully connected layer y = x @ w^T + b: forward, input gradient, weight/bias gradient.

    forward:      y  (N, out)  = x (N, in) @ w^T (in, out)        [+ b]
    input grad:   dx (N, in)   = dy (N, out) @ w (out, in)
    weight grad:  dw (out, in) += dy^T (out, N) @ x (N, in)
    bias grad:    db (out,)    += column sums of dy

Parallelism: BLAS is held to one thread (dynar/kernels/__init__.py), so every product is cut
into blocks of w's rows or columns, and OpenMP threads run one single-threaded GEMM per block.
A cut never crosses a summation dimension (in for y, out for dx, N for dw/db), so no partial
sums are combined. Blocks go along w because w is the large operand of a fully connected layer
(4096x4096 in AlexNet against a batch of 64): each GEMM then packs only its slice of w.
Block boundaries depend on the shapes only, never on the thread count, so every thread count
makes the same GEMM calls and gets bitwise equal results.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.string cimport memcpy
cimport numpy as cnp

from _blas cimport gemm
from _parallel cimport threads_for
from _validate cimport (F32, FloatKind, check_blas_dim, check_disjoint, check_float, check_shape,
                        data, float_kind)

cnp.import_array()

# Rows/columns of w per block. Each block's GEMM re-packs the operand all blocks share (x or
# dy), which costs 1/BLOCK of the block's arithmetic; narrower blocks would also leave the
# BLAS micro-kernels too little width. 4096 features still give 64 blocks to share out.
DEF BLOCK = 64


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   Py_ssize_t N, Py_ssize_t In, Py_ssize_t Out) noexcept nogil:
    """y: (N, Out); x: (N, In); w: (Out, In); b: (Out,) or NULL."""
    cdef Py_ssize_t blocks = (Out + BLOCK - 1) // BLOCK
    cdef Py_ssize_t blk, j0, cols, n
    cdef floating beta
    # Parallel over blocks of output columns (rows of w): independent GEMMs, each summing
    # over all of `in`, each touching only its own columns of y.
    for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        j0 = blk * BLOCK
        cols = BLOCK if j0 + BLOCK <= Out else Out - j0
        beta = 0
        if b != NULL:
            beta = 1
            for n in range(N):
                memcpy(y + n * Out + j0, b + j0, cols * sizeof(floating))
        gemm(False, True, <int> N, <int> cols, <int> In, <floating> 1, x, <int> In,
             w + j0 * In, <int> In, beta, y + j0, <int> Out)


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w,
                    Py_ssize_t N, Py_ssize_t In, Py_ssize_t Out) noexcept nogil:
    """dx: (N, In) or NULL; dw: (Out, In); db: (Out,) or NULL; dy: (N, Out); x: (N, In);
    w: (Out, In)."""
    cdef Py_ssize_t blocks, blk, i0, o0, cols, rows, o, n
    cdef floating acc
    if dx != NULL:
        blocks = (In + BLOCK - 1) // BLOCK
        # Parallel over blocks of dx's columns (columns of w): the `out` sum stays whole.
        for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
            i0 = blk * BLOCK
            cols = BLOCK if i0 + BLOCK <= In else In - i0
            gemm(False, False, <int> N, <int> cols, <int> Out, <floating> 1, dy, <int> Out,
                 w + i0, <int> In, <floating> 0, dx + i0, <int> In)
    blocks = (Out + BLOCK - 1) // BLOCK
    # Parallel over blocks of output features (rows of dw, entries of db): each thread owns
    # its rows outright and accumulates straight into dw/db; the batch sum stays whole.
    for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        o0 = blk * BLOCK
        rows = BLOCK if o0 + BLOCK <= Out else Out - o0
        gemm(True, False, <int> rows, <int> In, <int> N, <floating> 1, dy + o0, <int> Out,
             x, <int> In, <floating> 1, dw + o0 * In, <int> In)
        if db != NULL:
            for o in range(o0, o0 + rows):
                acc = 0
                for n in range(N):
                    acc = acc + dy[n * Out + o]
                db[o] += acc


cdef tuple _check_linear(str bias_name, object x, object w, object b, FloatKind* kind,
                         bint bias_output=False):
    """x, w and the bias (named bias_name, written to when bias_output) validated, as
    (x, w, b, N, in, out)."""
    kind[0] = float_kind("x", x)
    xa = check_float("x", x, 2, kind[0])
    if (<object> xa).size == 0:
        raise ValueError(f"x: every dimension must be >= 1, got shape {(<object> xa).shape}")
    wa = check_float("w", w, 2, kind[0])
    if (<object> wa).size == 0:
        raise ValueError(f"w: every dimension must be >= 1, got shape {(<object> wa).shape}")
    N, In = (<object> xa).shape
    Out, w_in = (<object> wa).shape
    if w_in != In:
        raise ValueError(f"w: expects {w_in} input features, x has {In}")
    ba = None
    if b is not None:
        ba = check_float(bias_name, b, 1, kind[0], bias_output)
        check_shape(bias_name, ba, (Out,))
    check_blas_dim("linear: batch size", N)
    check_blas_dim("linear: in_features", In)
    check_blas_dim("linear: out_features", Out)
    return xa, wa, ba, N, In, Out


def linear_forward(y, x, w, b=None):
    """y (N, out) = x (N, in) @ w (out, in)^T + b (out,).

    y is overwritten; b may be None."""
    cdef FloatKind kind
    xa, wa, ba, N, In, Out = _check_linear("b", x, w, b, &kind)
    ya = check_float("y", y, 2, kind, output=True)
    check_shape("y", ya, (N, Out))
    for name, other in (("x", xa), ("w", wa), ("b", ba)):
        if other is not None:
            check_disjoint("y", ya, name, other)
    cdef void* yp = data(ya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef void* bp = data(ba)
    cdef Py_ssize_t n = N, i = In, o = Out
    with nogil:
        if kind == F32:
            _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp, n, i, o)
        else:
            _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp, n, i, o)


def linear_backward(dx, dw, db, dy, x, w):
    """Gradients of linear_forward given dy (N, out).

    dx (N, in) is overwritten (None skips the input gradient, as for a first layer);
    dw (out, in) and db (out,) are accumulated into (+=); db may be None."""
    cdef FloatKind kind
    xa, wa, dba, N, In, Out = _check_linear("db", x, w, db, &kind, bias_output=True)
    dya = check_float("dy", dy, 2, kind)
    check_shape("dy", dya, (N, Out))
    dwa = check_float("dw", dw, 2, kind, output=True)
    check_shape("dw", dwa, (Out, In))
    dxa = None
    if dx is not None:
        dxa = check_float("dx", dx, 2, kind, output=True)
        check_shape("dx", dxa, (N, In))
    outputs = [("dx", dxa), ("dw", dwa), ("db", dba)]
    inputs = [("dy", dya), ("x", xa), ("w", wa)]
    for k, (out_name, out) in enumerate(outputs):
        if out is None:
            continue
        for in_name, other in inputs + outputs[k + 1:]:
            if other is not None:
                check_disjoint(out_name, out, in_name, other)
    cdef void* dxp = data(dxa)
    cdef void* dwp = data(dwa)
    cdef void* dbp = data(dba)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* wp = data(wa)
    cdef Py_ssize_t n = N, i = In, o = Out
    with nogil:
        if kind == F32:
            _backward(<float*> dxp, <float*> dwp, <float*> dbp, <float*> dyp, <float*> xp,
                      <float*> wp, n, i, o)
        else:
            _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                      <double*> xp, <double*> wp, n, i, o)
