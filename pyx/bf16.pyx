"""bf16 for mixed-precision training: conversions, a GEMM on bf16 operands, and the bf16
instructions this CPU has.

Every conversion rounds as include/bf16.h says (nearest, ties to even, NaN kept, subnormals
to zero), elementwise over arrays of any shape, cut into fixed chunks for the threads: the
result never depends on the thread count. `matmul` rounds its float32 operands the same way
as it packs them, for include/panel_gemm_bf16.h's panels and strips (AMX, AVX512_BF16,
BFMMLA) or include/bf16_gemm.h's portable tile kernel, and sums in float32;
each element of c is summed by one thread in a fixed order, so it too is independent of the
threads.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t
cimport numpy as cnp

from _panels cimport bf16_panel_count, bf16_panel_gemm, bf16_panel_pack, bf16_panel_size
from _parallel cimport threads_for
from _scratch cimport Scratch, scratch_give, scratch_take
from _validate cimport check_array, check_disjoint, check_shape, data

from dynar.kernels.conv import panel_block_bytes

cnp.import_array()

cdef extern from "bf16.h" nogil:
    uint16_t dynar_bf16_from_float(float value)
    float dynar_bf16_to_float(uint16_t half)
    float dynar_bf16_round(float value)
    int dynar_bf16_features()
    int DYNAR_BF16_AVX512, DYNAR_BF16_AMX, DYNAR_BF16_ARM

cdef extern from "bf16_gemm.h" nogil:
    int BF16_PANEL, BF16_KERNEL_PORTABLE, BF16_KERNEL_BFMMLA, BF16_KERNEL_AVX512
    int BF16_KERNEL_AMX
    Py_ssize_t bf16_packed_size(Py_ssize_t m, Py_ssize_t k)
    Py_ssize_t bf16_panels(Py_ssize_t m)
    void bf16_pack(uint16_t* packed, const float* x, Py_ssize_t m, Py_ssize_t k,
                   Py_ssize_t row_stride, Py_ssize_t depth_stride, Py_ssize_t p0,
                   Py_ssize_t p1)
    int bf16_kernel_runs(int kernel)
    void bf16_gemm_panel(float* c, Py_ssize_t ldc, const uint16_t* a, const uint16_t* b,
                         Py_ssize_t m, Py_ssize_t n, Py_ssize_t k, Py_ssize_t p,
                         Py_ssize_t q0, Py_ssize_t q1, bint add)

# The kernels of matmul, fastest first; all but the portable one are the convolutions' (the
# bf16 panel GEMM's kernel of each, below).
GEMM_KERNELS = {"amx_bf16": BF16_KERNEL_AMX, "bfmmla": BF16_KERNEL_BFMMLA,
                "avx512_bf16": BF16_KERNEL_AVX512, "portable": BF16_KERNEL_PORTABLE}
PANEL_KERNELS = {BF16_KERNEL_AMX: DYNAR_BF16_AMX, BF16_KERNEL_BFMMLA: DYNAR_BF16_ARM,
                 BF16_KERNEL_AVX512: DYNAR_BF16_AVX512}
# matmul's packed operands, kept between calls (pyx/_scratch.pxd): a layer's products are the
# same sizes step after step.
cdef Scratch _packed
# Column panels of c one thread's unit of matmul covers with one row panel.
DEF UNIT_PANELS = 16
# Columns of c one thread's unit covers on the panel kernels, every row (4 strips).
DEF PANEL_UNIT_COLUMNS = 192

# Elements per prange iteration, and the size at or below which one thread does all.
DEF CHUNK = 16384
DEF PARALLEL_MIN = 32768


cdef enum Conversion:
    TO_BF16         # uint16 out = bf16 of float x
    TO_FLOAT        # float out = the value of bf16 x
    ROUND           # float out = the float holding the bf16 nearest x


cdef void _span(Conversion op, void* out, const void* x, Py_ssize_t lo,
                Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint16_t* halves_out = <uint16_t*> out
    cdef float* floats_out = <float*> out
    cdef const uint16_t* halves = <const uint16_t*> x
    cdef const float* floats = <const float*> x
    if op == TO_BF16:
        for i in range(lo, hi):
            halves_out[i] = dynar_bf16_from_float(floats[i])
    elif op == TO_FLOAT:
        for i in range(lo, hi):
            floats_out[i] = dynar_bf16_to_float(halves[i])
    else:
        for i in range(lo, hi):
            floats_out[i] = dynar_bf16_round(floats[i])


cdef object _convert(Conversion op, str out_name, object out, int out_type, str x_name,
                     object x, int x_type):
    cdef int ndim = cnp.PyArray_NDIM(<cnp.ndarray> x) if isinstance(x, cnp.ndarray) else 1
    cdef cnp.ndarray xa = check_array(x_name, x, ndim, x_type)
    cdef cnp.ndarray outa = check_array(out_name, out, ndim, out_type, output=True)
    check_shape(out_name, outa, (<object> xa).shape)
    # In place is safe for ROUND (each element is read, then written); else disjoint.
    if not (op == ROUND and cnp.PyArray_DATA(outa) == cnp.PyArray_DATA(xa)):
        check_disjoint(out_name, outa, x_name, xa)
    cdef void* outp = data(outa)
    cdef void* xp = data(xa)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(xa), c, end
    cdef Py_ssize_t chunks = (n + CHUNK - 1) // CHUNK
    cdef int threads = threads_for(chunks)
    with nogil:
        if n <= PARALLEL_MIN:
            _span(op, outp, xp, 0, n)
        else:
            for c in prange(chunks, schedule="static", num_threads=threads):
                end = c * CHUNK + CHUNK
                _span(op, outp, xp, c * CHUNK, end if end < n else n)
    return out


def to_bf16(out, x):
    """out (uint16, the bf16 bits) = x (float32) rounded to bf16; same shape, any shape."""
    return _convert(TO_BF16, "out", out, cnp.NPY_UINT16, "x", x, cnp.NPY_FLOAT32)


def to_float32(out, x):
    """out (float32) = the values of x (uint16 holding bf16 bits); exact."""
    return _convert(TO_FLOAT, "out", out, cnp.NPY_FLOAT32, "x", x, cnp.NPY_UINT16)


def round_to_bf16(out, x):
    """out (float32) = x (float32) rounded to the nearest bf16 value: what a float32 kernel
    reads to compute as bf16 hardware does. out may be x itself."""
    return _convert(ROUND, "out", out, cnp.NPY_FLOAT32, "x", x, cnp.NPY_FLOAT32)


def cpu_features():
    """The bf16 instruction sets this process may run, as names: "avx512_bf16", "amx_bf16"
    (asking Linux for the tile state on the first call), "aarch64_bf16"; () for none."""
    cdef int bits = dynar_bf16_features()
    return tuple(name for bit, name in ((DYNAR_BF16_AVX512, "avx512_bf16"),
                                        (DYNAR_BF16_AMX, "amx_bf16"),
                                        (DYNAR_BF16_ARM, "aarch64_bf16")) if bits & bit)


def gemm_kernels():
    """The names of matmul's kernels this CPU runs, fastest first ("portable" last,
    which every CPU runs but no faster than float32 BLAS on rounded operands)."""
    return tuple(name for name, kernel in GEMM_KERNELS.items() if bf16_kernel_runs(kernel))


cdef void _matmul_panels(int kernel, float* c, const float* a, const float* b, Py_ssize_t m,
                         Py_ssize_t n, Py_ssize_t k, Py_ssize_t a_row, Py_ssize_t a_depth,
                         bint trans_b, bint add) except *:
    """matmul on include/panel_gemm_bf16.h's `kernel` (DYNAR_BF16_*): op(a) packed into
    bf16 panels (parallel over panels), then c in units of PANEL_UNIT_COLUMNS columns, every
    row, op(b) rounded a strip at a time: b (k, n) as it lies, or b (n, k) read as its
    transpose."""
    cdef bint private
    cdef uint16_t* panels = <uint16_t*> scratch_take(
        &_packed, bf16_panel_size(m, k) * sizeof(uint16_t), &private)
    cdef Py_ssize_t block = panel_block_bytes()
    cdef Py_ssize_t row_panels = bf16_panel_count(m)
    cdef Py_ssize_t units = (n + PANEL_UNIT_COLUMNS - 1) // PANEL_UNIT_COLUMNS
    cdef Py_ssize_t p, unit, j0, cols
    try:
        with nogil:
            for p in prange(row_panels, schedule="static",
                            num_threads=threads_for(row_panels)):
                bf16_panel_pack(panels, a, m, k, a_row, a_depth, p, p + 1)
            for unit in prange(units, schedule="static", num_threads=threads_for(units)):
                j0 = unit * PANEL_UNIT_COLUMNS
                cols = n - j0 if n - j0 < PANEL_UNIT_COLUMNS else PANEL_UNIT_COLUMNS
                bf16_panel_gemm(kernel, c + j0, n, panels, m, k,
                                b + (j0 * k if trans_b else j0), k if trans_b else n, trans_b,
                                cols, NULL, block, add)
    finally:
        scratch_give(&_packed, panels, private)


def matmul(c, a, b, trans_a=False, trans_b=False, accumulate=False, kernel=None):
    """c (m, n) = op(a) (m, k) @ op(b) (k, n), or c += that with `accumulate`: a and b
    float32, rounded to bf16 as they are read, the products summed in float32. op(x) is x,
    or x.T when trans_x. kernel: a name of gemm_kernels(); None takes the first."""
    cdef cnp.ndarray aa = check_array("a", a, 2, cnp.NPY_FLOAT32)
    cdef cnp.ndarray ba = check_array("b", b, 2, cnp.NPY_FLOAT32)
    cdef cnp.ndarray ca = check_array("c", c, 2, cnp.NPY_FLOAT32, output=True)
    if kernel is None:
        kernel = gemm_kernels()[0]
    if kernel not in GEMM_KERNELS or not bf16_kernel_runs(GEMM_KERNELS[kernel]):
        raise ValueError(f"kernel: expected one of {gemm_kernels()} on this CPU, "
                         f"got {kernel!r}")
    cdef int tile_kernel = GEMM_KERNELS[kernel]
    a_rows, a_cols = (<object> aa).shape
    b_rows, b_cols = (<object> ba).shape
    cdef Py_ssize_t m = a_cols if trans_a else a_rows
    cdef Py_ssize_t k = a_rows if trans_a else a_cols
    cdef Py_ssize_t n = b_rows if trans_b else b_cols
    if (b_cols if trans_b else b_rows) != k:
        raise ValueError(f"b: op(a) is {(m, k)}, so op(b) needs {k} rows; got shape "
                         f"{(b_rows, b_cols)} with trans_b={bool(trans_b)}")
    check_shape("c", ca, (m, n))
    check_disjoint("c", ca, "a", aa)
    check_disjoint("c", ca, "b", ba)
    # a as (m rows, depth k); b as its transpose, (n rows, depth k).
    cdef Py_ssize_t a_row = 1 if trans_a else k, a_depth = m if trans_a else 1
    cdef Py_ssize_t b_row = k if trans_b else 1, b_depth = 1 if trans_b else n
    if tile_kernel != BF16_KERNEL_PORTABLE:
        _matmul_panels(PANEL_KERNELS[tile_kernel], <float*> data(ca), <const float*> data(aa),
                       <const float*> data(ba), m, n, k, a_row, a_depth, trans_b, accumulate)
        return c
    # Both packed operands in the module's workspace, b's from a cache line on.
    cdef Py_ssize_t a_halves = (bf16_packed_size(m, k) + 31) // 32 * 32
    cdef bint private
    cdef uint16_t* ap = <uint16_t*> scratch_take(
        &_packed, (a_halves + bf16_packed_size(n, k)) * sizeof(uint16_t), &private)
    cdef uint16_t* bp = ap + a_halves
    cdef float* cp = <float*> data(ca)
    cdef const float* xa = <const float*> data(aa)
    cdef const float* xb = <const float*> data(ba)
    cdef Py_ssize_t row_panels = bf16_panels(m), col_panels = bf16_panels(n)
    cdef Py_ssize_t blocks = (col_panels + UNIT_PANELS - 1) // UNIT_PANELS
    cdef Py_ssize_t p, unit, q0, q1
    cdef bint add = accumulate
    try:
        with nogil:
            for p in prange(row_panels, schedule="static",
                            num_threads=threads_for(row_panels)):
                bf16_pack(ap, xa, m, k, a_row, a_depth, p, p + 1)
            for p in prange(col_panels, schedule="static",
                            num_threads=threads_for(col_panels)):
                bf16_pack(bp, xb, n, k, b_row, b_depth, p, p + 1)
            for unit in prange(row_panels * blocks, schedule="static",
                               num_threads=threads_for(row_panels * blocks)):
                q0 = unit % blocks * UNIT_PANELS
                q1 = q0 + UNIT_PANELS if q0 + UNIT_PANELS < col_panels else col_panels
                bf16_gemm_panel(cp, n, ap, bp, m, n, k, unit // blocks, q0, q1, add)
    finally:
        scratch_give(&_packed, ap, private)
    return c
