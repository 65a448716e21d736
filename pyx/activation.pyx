"""Elementwise layers: ReLU and dropout, forward and backward, and the residual add.

Arrays have any shape, but all arrays of one call share it and are C-contiguous, so every op
is a flat loop over n elements. An output may be the very same array as an input of its
dtype (in place); partial overlap is refused. Small arrays run on the calling thread; large
ones are cut into fixed-size chunks shared out with `prange`. Every element is computed the
same way whatever thread runs it, so results never depend on the thread count.

Dropout keeps element i when a counter-based hash of (seed, i) clears the threshold p: the
mask is a pure function of (seed, index), reproducible on any thread count or chunking, and
needs no generator state to be carried between calls or threads.
"""
import numbers

from cython cimport floating
from cython.parallel cimport prange
from libc.stdint cimport uint16_t, uint64_t
cimport numpy as cnp

from _parallel cimport threads_for
from _validate cimport F32, FloatKind, as_int, check_array, check_disjoint, check_shape, \
    data, float_kind, float_typenum

cnp.import_array()

cdef extern from "bf16.h" nogil:
    uint16_t dynar_bf16_from_float(float value)
    float dynar_bf16_to_float(uint16_t half)

# At or below this many elements one thread does the whole loop: opening a parallel region
# costs a few microseconds, about what one core needs to stream this many floats.
DEF PARALLEL_MIN = 32768
# Elements per prange iteration: long enough for the vectorized loop to reach full speed,
# short enough to spread a medium array over many cores.
DEF CHUNK = 8192


cdef enum Op:
    RELU            # out = a < 0 ? 0 : a
    RELU_BF16       # RELU, and halves = bf16 of out
    RELU_BACKWARD   # out = b <= 0 ? 0 : a         (a = dy, b = y)
    RELU_BACKWARD_BF16  # out = y <= 0 ? 0 : a     (a = dy, y = the value of halves)
    DROPOUT         # mask = keep(seed, i); out = a * mask * scale
    APPLY_MASK      # out = a * mask * scale       (dropout backward)
    ADD             # out = a + b


cdef struct Side:
    # What an op reads or writes besides out, a and b.
    unsigned char* keep   # (n,) 1 keep / 0 drop; written by DROPOUT, read by APPLY_MASK
    uint16_t* halves      # (n,) bf16 bits of a ReLU's output: RELU_BF16 writes, its backward reads
    uint64_t key          # splitmix64(seed)
    uint64_t threshold    # keep element i iff its 53-bit hash >= threshold = p * 2^53
    double scale          # 1 / (1 - p)


# For the ops that use neither (zero-initialized, as every module-level C variable).
cdef Side _NO_SIDE


cdef inline uint64_t _splitmix64(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef void _span(Op op, floating* out, const floating* a, const floating* b, Side m,
                Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """out, a, b, m.keep: (n,); elements [lo, hi) of op. One plain loop per op, the branch
    outside it, so gcc vectorizes each."""
    cdef Py_ssize_t i
    cdef floating v
    cdef floating scale = <floating> m.scale
    # splitmix64's increment (2^64 / golden ratio): consecutive indices land far apart.
    cdef uint64_t golden = 0x9E3779B97F4A7C15ULL
    if op == RELU:
        for i in range(lo, hi):
            v = a[i]
            out[i] = 0 if v < 0 else v   # NaN and -0.0 pass through, as torch.relu
    elif op == RELU_BF16:
        for i in range(lo, hi):
            v = a[i]
            v = 0 if v < 0 else v
            out[i] = v
            m.halves[i] = dynar_bf16_from_float(<float> v)
    elif op == RELU_BACKWARD:
        for i in range(lo, hi):
            out[i] = 0 if b[i] <= 0 else a[i]   # y NaN passes dy, as PyTorch
    elif op == RELU_BACKWARD_BF16:
        for i in range(lo, hi):
            out[i] = 0 if dynar_bf16_to_float(m.halves[i]) <= 0 else a[i]
    elif op == DROPOUT or op == APPLY_MASK:
        if op == DROPOUT:
            # The key is mixed from the seed, so nearby seeds give unrelated masks rather
            # than one sequence shifted by a few elements.
            for i in range(lo, hi):
                m.keep[i] = (_splitmix64(m.key + <uint64_t> i * golden) >> 11) >= m.threshold
        # A product, not a select: a dropped inf/NaN gives NaN, as x * mask * scale does.
        for i in range(lo, hi):
            out[i] = a[i] * (m.keep[i] * scale)
    else:   # ADD
        for i in range(lo, hi):
            out[i] = a[i] + b[i]


cdef void _elementwise(Op op, floating* out, const floating* a, const floating* b, Side m,
                       Py_ssize_t n, int threads) noexcept nogil:
    cdef Py_ssize_t c, end
    if n <= PARALLEL_MIN:
        _span(op, out, a, b, m, 0, n)
        return
    # Parallel over fixed chunks of the flat array: elements are independent, and chunks
    # (not one slice per thread) keep the split the same whatever the thread count.
    for c in prange((n + CHUNK - 1) // CHUNK, schedule="static", num_threads=threads):
        end = c * CHUNK + CHUNK
        _span(op, out, a, b, m, c * CHUNK, end if end < n else n)


cdef object _run(FloatKind kind, Op op, object out, object a, object b, Side m):
    """Runs op over validated arrays out, a, b (b may be None) of one shape."""
    cdef void* outp = data(out)
    cdef void* ap = data(a)
    cdef void* bp = data(b)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(<cnp.ndarray> out)
    cdef int threads = threads_for((n + CHUNK - 1) // CHUNK)
    with nogil:
        if kind == F32:
            _elementwise(op, <float*> outp, <float*> ap, <float*> bp, m, n, threads)
        else:
            _elementwise(op, <double*> outp, <double*> ap, <double*> bp, m, n, threads)


cdef cnp.ndarray _check_first(str name, object arr, FloatKind* kind):
    """The input that fixes dtype and shape of the call: a float32/float64 C-contiguous array
    of any shape with no zero-size dimension."""
    kind[0] = float_kind(name, arr)
    cdef cnp.ndarray a = check_array(name, arr, cnp.PyArray_NDIM(<cnp.ndarray> arr),
                                     float_typenum(kind[0]))
    if cnp.PyArray_SIZE(a) == 0:
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {(<object> a).shape}")
    return a


cdef cnp.ndarray _check_like(str name, object arr, cnp.ndarray ref, int typenum,
                             bint output=False):
    """`arr` with ref's shape and dtype `typenum`, C-contiguous."""
    cdef cnp.ndarray a = check_array(name, arr, cnp.PyArray_NDIM(ref), typenum, output)
    check_shape(name, a, (<object> ref).shape)
    return a


cdef object _check_alias(str out_name, cnp.ndarray out, str in_name, cnp.ndarray inp):
    """out may be inp itself (same start, dtype and shape: each element is read before it
    is written) or disjoint from it; anything in between would read overwritten data."""
    if cnp.PyArray_DATA(out) == cnp.PyArray_DATA(inp) \
            and cnp.PyArray_TYPE(out) == cnp.PyArray_TYPE(inp):
        return
    check_disjoint(out_name, out, in_name, inp)


def relu_forward(y, x, y_bf16=None):
    """y = max(x, 0) elementwise; x, y: same shape. y may be x itself (in place).
    y_bf16 (uint16, same shape, float32 x only): also receives y rounded to bf16 (bits, as
    kernels.bf16.to_bf16), in the same pass."""
    cdef FloatKind kind
    xa = _check_first("x", x, &kind)
    ya = _check_like("y", y, xa, float_typenum(kind), output=True)
    _check_alias("y", ya, "x", xa)
    if y_bf16 is None:
        _run(kind, RELU, ya, xa, None, _NO_SIDE)
        return
    ha = _bf16_bits("y_bf16", y_bf16, xa, kind, output=True)
    check_disjoint("y_bf16", ha, "x", xa)
    check_disjoint("y_bf16", ha, "y", ya)
    cdef Side side = _NO_SIDE
    side.halves = <uint16_t*> data(ha)
    _run(kind, RELU_BF16, ya, xa, None, side)


def relu_backward(dx, dy, y):
    """dx = dy where y > 0 else 0, y the output of relu_forward (where y is NaN, dx = dy,
    as PyTorch); dx, dy, y: same shape. dx may be dy itself (in place). y may also be the
    bf16 bits (uint16) relu_forward wrote to y_bf16, for float32 dy: the mask is then that
    of y rounded to bf16, which differs only where y is subnormal (bf16 rounds it to 0)."""
    cdef FloatKind kind
    dya = _check_first("dy", dy, &kind)
    dxa = _check_like("dx", dx, dya, float_typenum(kind), output=True)
    _check_alias("dx", dxa, "dy", dya)
    cdef Side side = _NO_SIDE
    if isinstance(y, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray> y) == cnp.NPY_UINT16:
        ha = _bf16_bits("y", y, dya, kind)
        check_disjoint("dx", dxa, "y", ha)
        side.halves = <uint16_t*> data(ha)
        _run(kind, RELU_BACKWARD_BF16, dxa, dya, None, side)
        return
    ya = _check_like("y", y, dya, float_typenum(kind))
    _check_alias("dx", dxa, "y", ya)
    _run(kind, RELU_BACKWARD, dxa, dya, ya, _NO_SIDE)


cdef cnp.ndarray _bf16_bits(str name, object arr, cnp.ndarray ref, FloatKind kind,
                            bint output=False):
    """`arr`: bf16 bits (uint16) of ref's shape, beside float32 data."""
    if kind != F32:
        raise TypeError(f"{name}: bf16 goes with float32 data, got {(<object> ref).dtype}")
    return _check_like(name, arr, ref, cnp.NPY_UINT16, output)


cdef Side _mask(object keep, object p, uint64_t seed) except *:
    """The dropout mask parameters for keep probability 1 - p, p a real number in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p: expected a real number, got {type(p).__name__}")
    cdef double pf
    try:
        pf = float(p)
    except OverflowError:   # an int past the largest double
        pf = float("inf")
    if not 0 <= pf < 1:
        raise ValueError(f"p: must be in [0, 1), got {p!r}")
    cdef Side m = _NO_SIDE
    m.keep = <unsigned char*> data(keep)
    m.key = _splitmix64(seed)
    # p < 1, so p * 2^53 rounds to at most 2^53 - 1: at least one hash value keeps.
    m.threshold = <uint64_t> (pf * 9007199254740992.0)
    m.scale = 1.0 / (1.0 - pf)
    return m


def dropout_forward(y, mask, x, p, seed):
    """y = x * mask / (1 - p) with mask (uint8, 1 keep / 0 drop) drawn with keep probability
    1 - p; x, y, mask: same shape; y, mask overwritten.

    p in [0, 1) (p = 0 keeps everything, y = x). seed: int in [0, 2^64); the mask is a pure
    function of (seed, flat element index). y may be x itself (in place)."""
    cdef FloatKind kind
    xa = _check_first("x", x, &kind)
    ya = _check_like("y", y, xa, float_typenum(kind), output=True)
    ma = _check_like("mask", mask, xa, cnp.NPY_UINT8, output=True)
    _check_alias("y", ya, "x", xa)
    check_disjoint("mask", ma, "x", xa)
    check_disjoint("mask", ma, "y", ya)
    seed = as_int("seed", seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed: must be in [0, 2^64), got {seed}")
    _run(kind, DROPOUT, ya, xa, None, _mask(ma, p, seed))


def dropout_backward(dx, dy, mask, p):
    """dx = dy * mask / (1 - p), mask (uint8) and p as given to dropout_forward; dx, dy,
    mask: same shape. dx may be dy itself (in place)."""
    cdef FloatKind kind
    dya = _check_first("dy", dy, &kind)
    ma = _check_like("mask", mask, dya, cnp.NPY_UINT8)
    dxa = _check_like("dx", dx, dya, float_typenum(kind), output=True)
    _check_alias("dx", dxa, "dy", dya)
    check_disjoint("dx", dxa, "mask", ma)
    _run(kind, APPLY_MASK, dxa, dya, None, _mask(ma, p, 0))   # seed unused: mask is given


def add(y, a, b):
    """y = a + b elementwise; a, b, y: same shape. y may be a or b itself (in place). A
    residual connection's forward sum, and in its backward the joining of the gradients of
    the two branches."""
    cdef FloatKind kind
    aa = _check_first("a", a, &kind)
    ba = _check_like("b", b, aa, float_typenum(kind))
    ya = _check_like("y", y, aa, float_typenum(kind), output=True)
    _check_alias("y", ya, "a", aa)
    _check_alias("y", ya, "b", ba)
    _run(kind, ADD, ya, aa, ba, _NO_SIDE)
