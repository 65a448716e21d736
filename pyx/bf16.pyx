"""bf16 conversions for mixed-precision training, and the bf16 instructions this CPU has.

Every conversion rounds as include/bf16.h says (nearest, ties to even, NaN kept, subnormals
to zero), elementwise over arrays of any shape, cut into fixed chunks for the threads: the
result never depends on the thread count.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t
cimport numpy as cnp

from _parallel cimport threads_for
from _validate cimport check_array, check_disjoint, check_shape, data

cnp.import_array()

cdef extern from "bf16.h" nogil:
    uint16_t dynar_bf16_from_float(float value)
    float dynar_bf16_to_float(uint16_t half)
    float dynar_bf16_round(float value)
    int dynar_bf16_features()
    int DYNAR_BF16_AVX512, DYNAR_BF16_AMX, DYNAR_BF16_ARM

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
