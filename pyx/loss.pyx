"""Softmax cross-entropy over a batch of logits: mean loss, and its gradient w.r.t. the logits.

    forward:   probs[n] = softmax(logits[n])
               loss = mean over n of  logsumexp(logits[n]) - logits[n, labels[n]]
    backward:  dlogits = (probs - onehot(labels)) * scale / N

logsumexp subtracts the row maximum before exponentiating, so logits of +-1e4 neither
overflow nor underflow to log(0); the loss is taken from logsumexp, never from log(probs),
which is -inf once a probability rounds to zero. Exponentials and sums run in double.

Parallelism: prange over rows (samples). Each row's loss goes to its own slot and the slots
are summed in row order afterwards, so the loss is bitwise the same for every thread count.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport exp, log
from _scratch cimport Scratch, scratch_give, scratch_take
cimport numpy as cnp

from _parallel cimport threads_for
from _validate cimport (check_real, F32, FloatKind, check_array, check_disjoint, check_float, check_shape,
                        data, float_kind)

cnp.import_array()

cdef Scratch _row_losses   # per-row losses of the forward pass, reused across calls


cdef double _forward(floating* probs, double* row_loss, const floating* logits,
                     const cnp.int64_t* labels, Py_ssize_t N, Py_ssize_t K) noexcept nogil:
    """Mean loss; probs: (N, K), row_loss: (N,) scratch, logits: (N, K), labels: (N,)."""
    cdef Py_ssize_t n, k
    cdef const floating* row
    cdef floating* p
    cdef double top, e, total
    # Parallel over rows: every sample's softmax and loss are independent of the others.
    for n in prange(N, schedule="static", num_threads=threads_for(N)):
        row = logits + n * K
        p = probs + n * K
        top = row[0]
        for k in range(1, K):
            if row[k] > top:
                top = row[k]
        total = 0
        for k in range(K):
            e = exp(row[k] - top)
            p[k] = <floating> e
            total = total + e
        for k in range(K):
            p[k] = <floating> (p[k] / total)
        row_loss[n] = log(total) + top - row[labels[n]]
    total = 0
    for n in range(N):
        total = total + row_loss[n]
    return total / N


cdef void _backward(floating* dlogits, const floating* probs, const cnp.int64_t* labels,
                    floating coef, Py_ssize_t N, Py_ssize_t K) noexcept nogil:
    """dlogits, probs: (N, K); labels: (N,); coef = scale / N."""
    cdef Py_ssize_t n, k, off
    # Parallel over rows: each row of dlogits depends on its own row of probs only.
    for n in prange(N, schedule="static", num_threads=threads_for(N)):
        off = n * K
        for k in range(K):
            dlogits[off + k] = probs[off + k] * coef
        off = off + labels[n]
        dlogits[off] = (probs[off] - 1) * coef




cdef tuple _check_rows(str name, object arr, object labels, FloatKind* kind):
    """The (N, K) float array `arr` and int64 labels (N,) each in [0, K), validated, as
    (arr, labels, N, K)."""
    kind[0] = float_kind(name, arr)
    a = check_float(name, arr, 2, kind[0])
    shape = (<object> a).shape
    if (<object> a).size == 0:
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {shape}")
    N, K = shape
    la = check_array("labels", labels, 1, cnp.NPY_INT64)
    check_shape("labels", la, (N,))
    cdef const cnp.int64_t* lab = <const cnp.int64_t*> data(la)
    cdef Py_ssize_t n
    for n in range(N):
        if lab[n] < 0 or lab[n] >= K:
            raise ValueError(f"labels: labels[{n}] = {lab[n]} is not a class index in [0, {K})")
    return a, la, N, K


def softmax_cross_entropy_forward(probs, logits, labels):
    """Mean softmax cross-entropy of logits (N, K) against int64 labels (N,), as a float.

    probs (N, K) is overwritten with softmax(logits), which backward takes."""
    cdef FloatKind kind
    logitsa, la, N, K = _check_rows("logits", logits, labels, &kind)
    probsa = check_float("probs", probs, 2, kind, output=True)
    check_shape("probs", probsa, (N, K))
    check_disjoint("probs", probsa, "logits", logitsa)
    cdef bint private
    cdef double* row_loss = <double*> scratch_take(&_row_losses, N * sizeof(double), &private)
    cdef void* pp = data(probsa)
    cdef void* lp = data(logitsa)
    cdef const cnp.int64_t* lab = <const cnp.int64_t*> data(la)
    cdef Py_ssize_t n = N, k = K
    cdef double loss
    try:
        with nogil:
            if kind == F32:
                loss = _forward(<float*> pp, row_loss, <float*> lp, lab, n, k)
            else:
                loss = _forward(<double*> pp, row_loss, <double*> lp, lab, n, k)
    finally:
        scratch_give(&_row_losses, row_loss, private)
    return loss


def softmax_cross_entropy_backward(dlogits, probs, labels, scale=1.0):
    """dlogits (N, K) = (probs (N, K) - onehot(labels (N,))) * scale / N, overwritten.

    scale is d(total loss)/d(mean cross-entropy), 1 when the cross-entropy is the loss."""
    cdef FloatKind kind
    probsa, la, N, K = _check_rows("probs", probs, labels, &kind)
    cdef double coef = check_real("scale", scale) / N
    dla = check_float("dlogits", dlogits, 2, kind, output=True)
    check_shape("dlogits", dla, (N, K))
    check_disjoint("dlogits", dla, "probs", probsa)
    cdef void* dp = data(dla)
    cdef void* pp = data(probsa)
    cdef const cnp.int64_t* lab = <const cnp.int64_t*> data(la)
    cdef Py_ssize_t n = N, k = K
    with nogil:
        if kind == F32:
            _backward(<float*> dp, <float*> pp, lab, <float> coef, n, k)
        else:
            _backward(<double*> dp, <double*> pp, lab, coef, n, k)
