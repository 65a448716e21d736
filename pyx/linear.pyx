"""Fully connected layer y = x @ w^T + b: forward, input gradient, weight/bias gradient.

    forward:      y  (N, out)  = x (N, in) @ w^T (in, out)        [+ b]
    input grad:   dx (N, in)   = dy (N, out) @ w (out, in)
    weight grad:  dw (out, in) += dy^T (out, N) @ x (N, in)   (= with accumulate off)
    bias grad:    db (out,)    += column sums of dy            (= with accumulate off)

Parallelism: BLAS is held to one thread (dynar/kernels/__init__.py), so each product's output
is cut into blocks of rows or of columns, and OpenMP threads run one single-threaded GEMM per
block. A cut never crosses the summation dimension (in for y, out for dx, N for dw), so no
partial sums are combined. Which way to cut, and how wide, is each call's `cut`: ROWS or
COLS and a width. Cutting along w (y's and dx's columns, dw's rows) packs only a slice of the
large operand per block; cutting along the batch keeps every thread busy where w has fewer
rows than a block (a 10-class head). nn/kernel_tuning.py times the cuts per layer shape.
Block boundaries depend on the shapes and the cut only, never on the thread count, so every
thread count makes the same GEMM calls and gets bitwise equal results.

y and dx can also run on dynar's panel GEMM (include/panel_gemm.h), cut PANELS: x or dy, a
batch of rows, is packed once, and w is the GEMM's right operand (transposed into the
GEMM's strips for y, read in place for dx), so each block of columns streams its slice of w
once, where a BLAS call packs it first. Blocks are `width` columns rounded up to whole
strips of the GEMM (48 floats with AVX-512).
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.string cimport memcpy
cimport numpy as cnp

from _blas cimport gemm
from _panels cimport (PANEL_VECTOR_BYTES, PANEL_VECTORS, Weights, pack_panel, panel_count,
                      panel_gemm_d, panel_gemm_f, panel_size, weights_operand)
from _parallel cimport threads_for
from _scratch cimport Scratch, scratch_give, scratch_release, scratch_take
from _validate cimport (F32, FloatKind, check_blas_dim, check_disjoint, check_float, check_shape,
                        data, float_kind)

from dynar.kernels.conv import panel_block_bytes

cnp.import_array()

cdef enum:
    BY_ROWS = 0
    BY_COLS = 1
    ON_PANELS = 2
ROWS, COLS, PANELS = BY_ROWS, BY_COLS, ON_PANELS
# The cut each product had before tuning, and keeps with DYNAR_KERNEL_TUNE=0: along w in
# blocks of 64 (each block's GEMM re-packs the operand all blocks share, 1/64 of its work).
DEFAULT_CUT = (COLS, 64)
DEFAULT_DW_CUT = (ROWS, 64)
DEF DB_BLOCK = 64

cdef Scratch _packed    # x or dy in row panels, for y's and dx's PANELS cuts
# Columns of the panel GEMM's strips: a PANELS block is a whole number of them.
PANEL_STRIP_FLOATS = PANEL_VECTORS * PANEL_VECTOR_BYTES // 4


def workspace_bytes():
    """Bytes of the PANELS cuts' workspace held between calls."""
    return _packed.size


def release_workspace():
    """Free the PANELS cuts' workspace (kernel tuning, after timing them)."""
    scratch_release(&_packed, "fully connected")


cdef void _cut_gemm(int axis, Py_ssize_t width, bint trans_a, bint trans_b,
                    Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                    const floating* a, Py_ssize_t lda, const floating* b, Py_ssize_t ldb,
                    floating beta, floating* c, Py_ssize_t ldc) noexcept nogil:
    """c (M, N) = op(a) (M, K) @ op(b) (K, N) + beta * c, row-major, as one GEMM per block
    of `width` rows (axis ROWS) or columns (COLS) of c, the blocks shared among threads."""
    cdef Py_ssize_t extent = M if axis == BY_ROWS else N
    cdef Py_ssize_t blocks = (extent + width - 1) // width
    cdef Py_ssize_t blk, s, n
    for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        s = blk * width
        n = width if s + width <= extent else extent - s
        if axis == BY_ROWS:    # rows s.. of op(a): rows of a, or its columns when transposed
            gemm(trans_a, trans_b, <int> n, <int> N, <int> K, <floating> 1,
                 a + (s if trans_a else s * lda), <int> lda, b, <int> ldb,
                 beta, c + s * ldc, <int> ldc)
        else:               # columns s.. of op(b)
            gemm(trans_a, trans_b, <int> M, <int> n, <int> K, <floating> 1, a, <int> lda,
                 b + (s * ldb if trans_b else s), <int> ldb, beta, c + s, <int> ldc)


cdef void _on_panels(floating* c, floating* panels, const floating* a, const floating* b,
                     bint b_transposed, const floating* bias, Py_ssize_t m, Py_ssize_t k,
                     Py_ssize_t n, Py_ssize_t width, Py_ssize_t block_bytes) noexcept nogil:
    """c (m, n) = a (m, k) @ op(b) [+ bias (n,) on every row] on the panel GEMM, op(b) being
    b (k, n) or, b_transposed, b^T (b: n, k): a, a batch of rows, packed into `panels`
    (panel_size(m, k)), then blocks of `width` columns of c rounded up to whole strips,
    shared among threads."""
    cdef Py_ssize_t strip = PANEL_VECTORS * (PANEL_VECTOR_BYTES // sizeof(floating))
    cdef Py_ssize_t cols = (width + strip - 1) // strip * strip
    cdef Py_ssize_t rows = panel_count(m), blocks = (n + cols - 1) // cols
    cdef Py_ssize_t p, blk, j0, nb, i, j
    cdef const floating* bj
    cdef Weights packed = weights_operand(m, k, False, panels, block_bytes, 0)
    for p in prange(rows, schedule="static", num_threads=threads_for(rows)):
        pack_panel(&packed, a, p)
    for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        j0 = blk * cols
        nb = cols if j0 + cols <= n else n - j0
        bj = b + (j0 * k if b_transposed else j0)
        if floating is float:
            panel_gemm_f(c + j0, n, panels, m, k, bj, k if b_transposed else n, b_transposed,
                         nb, NULL, block_bytes)
        else:
            panel_gemm_d(c + j0, n, panels, m, k, bj, k if b_transposed else n, b_transposed,
                         nb, NULL, block_bytes)
        if bias != NULL:
            for i in range(m):
                for j in range(j0, j0 + nb):
                    c[i * n + j] += bias[j]


cdef void _forward(floating* y, const floating* x, const floating* w, const floating* b,
                   Py_ssize_t N, Py_ssize_t In, Py_ssize_t Out, int axis, Py_ssize_t width,
                   floating* panels, Py_ssize_t block_bytes) noexcept nogil:
    """y: (N, Out); x: (N, In); w: (Out, In); b: (Out,) or NULL. panels: panel_size(N, In)
    of workspace where the cut is PANELS."""
    cdef Py_ssize_t n
    cdef floating beta = 0
    if axis == ON_PANELS:
        _on_panels(y, panels, x, w, True, b, N, In, Out, width, block_bytes)
        return
    if b != NULL:
        beta = 1
        for n in range(N):
            memcpy(y + n * Out, b, Out * sizeof(floating))
    _cut_gemm(axis, width, False, True, N, Out, In, x, In, w, In, beta, y, Out)


cdef void _backward(floating* dx, floating* dw, floating* db, const floating* dy,
                    const floating* x, const floating* w,
                    Py_ssize_t N, Py_ssize_t In, Py_ssize_t Out,
                    int dx_axis, Py_ssize_t dx_width,
                    int dw_axis, Py_ssize_t dw_width, bint accumulate,
                    floating* panels, Py_ssize_t block_bytes) noexcept nogil:
    """dx: (N, In) or NULL; dw: (Out, In); db: (Out,) or NULL; dy: (N, Out); x: (N, In);
    w: (Out, In). dw and db are added to, or overwritten when not accumulate. panels:
    panel_size(N, Out) of workspace where dx's cut is PANELS."""
    cdef floating keep = 1 if accumulate else 0     # BLAS reads no c at beta 0
    if dx != NULL and dx_axis == ON_PANELS:
        _on_panels(dx, panels, dy, w, False, NULL, N, Out, In, dx_width, block_bytes)
    elif dx != NULL:
        _cut_gemm(dx_axis, dx_width, False, False, N, In, Out, dy, Out, w, In,
                  <floating> 0, dx, In)
    _cut_gemm(dw_axis, dw_width, True, False, Out, In, N, dy, Out, x, In, keep, dw, In)
    if db != NULL:
        _bias_gradient(db, dy, N, Out, accumulate)


cdef void _bias_gradient(floating* db, const floating* dy, Py_ssize_t N, Py_ssize_t Out,
                         bint accumulate) noexcept nogil:
    """db (Out,) (+)= the column sums of dy (N, Out), each in double in a fixed order."""
    cdef Py_ssize_t blocks, blk, o0
    blocks = (Out + DB_BLOCK - 1) // DB_BLOCK
    for blk in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        o0 = blk * DB_BLOCK
        _bias_gradient_block(db, dy, N, Out, o0, o0 + DB_BLOCK if o0 + DB_BLOCK <= Out else Out,
                             accumulate)


cdef inline void _bias_gradient_block(floating* db, const floating* dy, Py_ssize_t N,
                                      Py_ssize_t Out, Py_ssize_t o0, Py_ssize_t o1,
                                      bint accumulate) noexcept nogil:
    """The outputs o0 <= o < o1: one double sum each over the rows in order, the block's
    sums side by side so that each row adds as one vector."""
    cdef double sums[DB_BLOCK]
    cdef Py_ssize_t n, o
    for o in range(o1 - o0):
        sums[o] = 0
    for n in range(N):
        for o in range(o1 - o0):
            sums[o] = sums[o] + dy[n * Out + o0 + o]
    for o in range(o0, o1):
        if accumulate:
            db[o] += <floating> sums[o - o0]
        else:       # never keep * db[o]: a stale NaN there would survive the 0
            db[o] = <floating> sums[o - o0]


cdef void _check_cut(str name, object cut, int* axis, Py_ssize_t* width,
                     bint panels=False) except *:
    ways = "ROWS, COLS or PANELS" if panels else "ROWS or COLS"
    try:
        a, w = cut
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected ({ways}, width), got {cut!r}") from None
    if a not in ((ROWS, COLS, PANELS) if panels else (ROWS, COLS)) or not isinstance(w, int) \
            or w < 1:
        raise ValueError(f"{name}: expected ({ways}, width >= 1), got {cut!r}")
    axis[0], width[0] = a, w


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


def linear_forward(y, x, w, b=None, cut=DEFAULT_CUT):
    """y (N, out) = x (N, in) @ w (out, in)^T + b (out,).

    y is overwritten; b may be None. cut: (ROWS, width) blocks of the batch or (COLS, width)
    of output features per thread, or (PANELS, width) output features on the panel GEMM."""
    cdef FloatKind kind
    cdef int axis
    cdef Py_ssize_t width
    _check_cut("cut", cut, &axis, &width, panels=True)
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
    cdef bint private = False
    cdef void* panels = NULL
    cdef Py_ssize_t block = 0
    if axis == ON_PANELS:
        block = panel_block_bytes()
        panels = scratch_take(&_packed, panel_size(N, In) * (<object> xa).itemsize, &private)
    try:
        with nogil:
            if kind == F32:
                _forward(<float*> yp, <float*> xp, <float*> wp, <float*> bp, n, i, o, axis,
                         width, <float*> panels, block)
            else:
                _forward(<double*> yp, <double*> xp, <double*> wp, <double*> bp, n, i, o,
                         axis, width, <double*> panels, block)
    finally:
        if panels != NULL:
            scratch_give(&_packed, panels, private)


def linear_backward(dx, dw, db, dy, x, w, dx_cut=DEFAULT_CUT, dw_cut=DEFAULT_DW_CUT,
                    accumulate=True):
    """Gradients of linear_forward given dy (N, out).

    dx (N, in) is overwritten (None skips the input gradient, as for a first layer);
    dw (out, in) and db (out,) are accumulated into (+=), or overwritten when `accumulate`
    is false (whatever they held, NaN included, is never read); db may be None. dx_cut: (ROWS,
    width) blocks of the batch or (COLS, width) of input features per thread, or (PANELS,
    width) input features on the panel GEMM; dw_cut: (ROWS, width) of output features or
    (COLS, width) of input features."""
    cdef FloatKind kind
    cdef int dx_axis, dw_axis
    cdef Py_ssize_t dx_width, dw_width
    _check_cut("dx_cut", dx_cut, &dx_axis, &dx_width, panels=True)
    _check_cut("dw_cut", dw_cut, &dw_axis, &dw_width)
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
    cdef bint keep_dw = accumulate
    cdef bint private = False
    cdef void* panels = NULL
    cdef Py_ssize_t block = 0
    if dxa is not None and dx_axis == ON_PANELS:
        block = panel_block_bytes()
        panels = scratch_take(&_packed, panel_size(N, Out) * (<object> dya).itemsize, &private)
    try:
        with nogil:
            if kind == F32:
                _backward(<float*> dxp, <float*> dwp, <float*> dbp, <float*> dyp, <float*> xp,
                          <float*> wp, n, i, o, dx_axis, dx_width, dw_axis, dw_width, keep_dw,
                          <float*> panels, block)
            else:
                _backward(<double*> dxp, <double*> dwp, <double*> dbp, <double*> dyp,
                          <double*> xp, <double*> wp, n, i, o, dx_axis, dx_width, dw_axis,
                          dw_width, keep_dw, <double*> panels, block)
    finally:
        if panels != NULL:
            scratch_give(&_packed, panels, private)


def bias_gradient(db, dy, accumulate=True):
    """db (out,) += the column sums of dy (N, out), or = them when not `accumulate`: the
    bias gradient linear_backward computes, for a layer whose products run elsewhere (the
    bf16 GEMM kernels), summed the same way."""
    cdef FloatKind kind = float_kind("dy", dy)
    dya = check_float("dy", dy, 2, kind)
    if (<object> dya).size == 0:
        raise ValueError(f"dy: every dimension must be >= 1, got shape {(<object> dya).shape}")
    N, Out = (<object> dya).shape
    dba = check_float("db", db, 1, kind, output=True)
    check_shape("db", dba, (Out,))
    check_disjoint("db", dba, "dy", dya)
    cdef void* dbp = data(dba)
    cdef void* dyp = data(dya)
    cdef Py_ssize_t n = N, o = Out
    cdef bint keep = accumulate
    with nogil:
        if kind == F32:
            _bias_gradient(<float*> dbp, <float*> dyp, n, o, keep)
        else:
            _bias_gradient(<double*> dbp, <double*> dyp, n, o, keep)
