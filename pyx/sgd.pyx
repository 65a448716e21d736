"""One fused SGD step over the flat parameter, gradient and momentum buffers (torch.optim.SGD).

Per element, in the parameters' precision:
    d = g + weight_decay p                                   (if weight_decay != 0)
    if momentum != 0:
        buf = momentum buf + (1 - dampening) d
        d = d + momentum buf   if nesterov   else   buf
    p = p - lr d

PyTorch starts the buffer as a copy of the first d; dynar starts it at zero, and with
dampening 0 the first step gives buf = momentum*0 + 1*d = d bit for bit, so no first-step
flag is needed. PyTorch also leaves that first d undamped: a caller using dampening > 0
matches it by passing dampening=0 on the first step.

Parallelism: prange over chunks of CHUNK elements. Every element is updated on its own, so the
thread count never changes a bit of the result.

`all_finite` is the check that decides whether a step updates at all: a non-finite gradient
must stop (or skip) the step before it reaches the parameters.
"""
from cython cimport floating
from libc.stdint cimport uint32_t, uint64_t
from cython.parallel cimport prange
cimport numpy as cnp

from _parallel cimport threads_for
from _validate cimport check_real, F32, FloatKind, check_disjoint, check_float, check_shape, data, float_kind

cnp.import_array()

# Elements per parallel work item: below this the update takes a few microseconds, less
# than waking a second thread costs, so small buffers run on one thread.
DEF CHUNK = 32768


cdef void _step(floating* p, floating* buf, const floating* g, Py_ssize_t n, floating lr,
                floating momentum, floating weight_decay, floating keep,
                bint nesterov) noexcept nogil:
    """p, g: (n,); buf: (n,), or NULL for no momentum; keep = 1 - dampening."""
    cdef Py_ssize_t chunks = (n + CHUNK - 1) // CHUNK
    cdef int threads = threads_for(chunks)
    cdef Py_ssize_t chunk, lo, hi, i
    cdef floating d
    # Parallel over chunks of elements: the update of each element reads and writes only that
    # element. The branches test loop-invariant flags, which the compiler hoists out.
    for chunk in prange(chunks, schedule="static", num_threads=threads):
        lo = chunk * CHUNK
        hi = lo + CHUNK if lo + CHUNK < n else n
        for i in range(lo, hi):
            d = g[i]
            # Skipped, not multiplied by 0, at weight_decay 0: 0 * inf would poison d.
            if weight_decay != 0:
                d = d + weight_decay * p[i]
            if buf != NULL:
                buf[i] = momentum * buf[i] + keep * d
                if nesterov:
                    d = d + momentum * buf[i]
                else:
                    d = buf[i]
            p[i] = p[i] - lr * d




def sgd_step(params, grads, momentum_buf, lr, momentum=0.0, weight_decay=0.0, nesterov=False,
             dampening=0.0):
    """params (n,) -= lr * the SGD direction from grads (n,), in place, as torch.optim.SGD.

    momentum_buf (n,) holds the velocity between steps (start it at zeros) and is updated in
    place; it may be None when momentum == 0, and is left untouched then."""
    cdef FloatKind kind = float_kind("params", params)
    pa = check_float("params", params, 1, kind, output=True)
    if (<object> pa).size == 0:
        raise ValueError("params: must have at least one element")
    ga = check_float("grads", grads, 1, kind)
    check_shape("grads", ga, (<object> pa).shape)
    check_disjoint("params", pa, "grads", ga)
    cdef double c_lr = check_real("lr", lr)
    cdef double c_momentum = check_real("momentum", momentum)
    cdef double c_weight_decay = check_real("weight_decay", weight_decay)
    cdef double c_dampening = check_real("dampening", dampening)
    for name, value in (("lr", c_lr), ("momentum", c_momentum),
                        ("weight_decay", c_weight_decay)):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value!r}")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov: expected a bool, got {type(nesterov).__name__}")
    if nesterov and (c_momentum <= 0 or c_dampening != 0):
        raise ValueError("nesterov: Nesterov momentum requires momentum > 0 and dampening == 0")
    ba = None
    if momentum_buf is not None:
        ba = check_float("momentum_buf", momentum_buf, 1, kind, output=True)
        check_shape("momentum_buf", ba, (<object> pa).shape)
        check_disjoint("momentum_buf", ba, "params", pa)
        check_disjoint("momentum_buf", ba, "grads", ga)
    elif c_momentum != 0:
        raise ValueError(f"momentum_buf: required when momentum != 0 (momentum = {momentum!r})")
    cdef void* pp = data(pa)
    cdef void* gp = data(ga)
    cdef void* bp = data(ba) if c_momentum != 0 else NULL
    cdef Py_ssize_t n = (<object> pa).size
    cdef bint c_nesterov = nesterov
    with nogil:
        if kind == F32:
            _step(<float*> pp, <float*> bp, <float*> gp, n, <float> c_lr, <float> c_momentum,
                  <float> c_weight_decay, <float> (1 - c_dampening), c_nesterov)
        else:
            _step(<double*> pp, <double*> bp, <double*> gp, n, c_lr, c_momentum,
                  c_weight_decay, 1 - c_dampening, c_nesterov)


cdef bint _any_nonfinite(const char* p, Py_ssize_t n, FloatKind kind) noexcept nogil:
    # A float is inf or NaN exactly when its exponent bits are all ones: an integer test,
    # which vectorizes (a float reduction would not, without reassociation).
    cdef Py_ssize_t chunks = (n + CHUNK - 1) // CHUNK
    cdef int threads = threads_for(chunks)
    cdef Py_ssize_t chunk, lo, hi, i
    cdef int bad = 0
    cdef const uint32_t* u = <const uint32_t*> p
    cdef const uint64_t* v = <const uint64_t*> p
    cdef uint32_t found32
    cdef uint64_t found64
    for chunk in prange(chunks, schedule="static", num_threads=threads):
        lo = chunk * CHUNK
        hi = lo + CHUNK if lo + CHUNK < n else n
        found32 = 0
        found64 = 0
        if kind == F32:
            for i in range(lo, hi):
                found32 = found32 | ((u[i] & 0x7f800000u) == 0x7f800000u)
        else:
            for i in range(lo, hi):
                found64 = found64 | ((v[i] & 0x7ff0000000000000u) == 0x7ff0000000000000u)
        bad += <int> (found32 | found64)
    return bad != 0


def all_finite(x):
    """Whether every element of `x` (1-D float32/float64, C-contiguous) is finite (not inf,
    not NaN): one parallel pass at memory speed."""
    cdef FloatKind kind = float_kind("x", x)
    xa = check_float("x", x, 1, kind)
    cdef const char* p = <const char*> data(xa)
    cdef Py_ssize_t n = (<object> xa).size
    cdef bint bad
    with nogil:
        bad = _any_nonfinite(p, n, kind)
    return not bad
