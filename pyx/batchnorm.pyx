"""2-D batch normalization over NCHW, statistics per channel over (N, H, W): forward, backward.

With m = N*H*W values per channel, as torch.nn.BatchNorm2d:
    training:  mean = sum(x) / m,  var = sum((x - mean)^2) / m,  invstd = 1 / sqrt(var + eps)
               running_mean = (1 - momentum) running_mean + momentum mean
               running_var  = (1 - momentum) running_var  + momentum var m / (m - 1)  (unbiased)
    eval:      mean = running_mean,  invstd = 1 / sqrt(running_var + eps)
    both:      y = (x - mean) invstd gamma + beta
Backward, with xhat = (x - mean) invstd:
    dbeta += sum(dy),  dgamma += sum(dy xhat)
    training:  dx = gamma invstd (dy - sum(dy) / m - xhat sum(dy xhat) / m)   (the batch
               statistics depend on x)
    eval:      dx = gamma invstd dy

Sums run in double and the variance takes a second pass over the centred values: the float32
one-pass E[x^2] - E[x]^2 loses every digit once |mean| is large against the spread.

Parallelism: prange over channels. A channel's sums stay in one thread in a fixed order, so
results are bitwise the same for every thread count.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport sqrt
cimport numpy as cnp

from _parallel cimport threads_for
from _validate cimport check_real, F32, FloatKind, check_disjoint, check_float, check_shape, data, float_kind

cnp.import_array()


cdef void _forward(floating* y, floating* mean, floating* invstd, floating* running_mean,
                   floating* running_var, const floating* x, const floating* gamma,
                   const floating* beta, bint training, double momentum, double eps,
                   Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """y, x: (N, C, HW); mean, invstd, running_mean, running_var, gamma, beta: (C,)."""
    cdef Py_ssize_t m = N * HW
    cdef Py_ssize_t c, n, i
    cdef const floating* xc
    cdef floating* yc
    cdef double mu, acc, dev, var
    cdef floating mu_c, scale, shift
    # Parallel over channels: each channel's statistics and outputs are independent of the
    # others, and each of its sums stays in one thread.
    for c in prange(C, schedule="static", num_threads=threads_for(C)):
        if training:
            acc = 0
            for n in range(N):
                xc = x + (n * C + c) * HW
                for i in range(HW):
                    acc = acc + xc[i]
            mu = acc / m
            acc = 0
            for n in range(N):
                xc = x + (n * C + c) * HW
                for i in range(HW):
                    dev = xc[i] - mu
                    acc = acc + dev * dev
            var = acc / m
            mean[c] = <floating> mu
            invstd[c] = <floating> (1 / sqrt(var + eps))
            running_mean[c] = <floating> ((1 - momentum) * running_mean[c] + momentum * mu)
            running_var[c] = <floating> ((1 - momentum) * running_var[c]
                                         + momentum * var * m / (m - 1))
        else:
            mean[c] = running_mean[c]
            invstd[c] = <floating> (1 / sqrt(running_var[c] + eps))
        # Normalize with the rounded mean/invstd that backward will be given.
        mu_c = mean[c]
        scale = invstd[c] * gamma[c]
        shift = beta[c]
        for n in range(N):
            xc = x + (n * C + c) * HW
            yc = y + (n * C + c) * HW
            for i in range(HW):
                yc[i] = (xc[i] - mu_c) * scale + shift


cdef void _backward(floating* dx, floating* dgamma, floating* dbeta, const floating* dy,
                    const floating* x, const floating* gamma, const floating* mean,
                    const floating* invstd, bint training,
                    Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """dx, dy, x: (N, C, HW); dgamma, dbeta, gamma, mean, invstd: (C,)."""
    cdef Py_ssize_t m = N * HW
    cdef Py_ssize_t c, n, i, off
    cdef double sum_dy, sum_dy_xc
    cdef floating mu_c, scale, mean_dy, xc_coef
    # Parallel over channels, as forward: a channel's sums and its dx slice are its own.
    for c in prange(C, schedule="static", num_threads=threads_for(C)):
        mu_c = mean[c]
        sum_dy = 0
        sum_dy_xc = 0       # sum(dy (x - mean)); times invstd it is sum(dy xhat)
        for n in range(N):
            off = (n * C + c) * HW
            for i in range(HW):
                sum_dy = sum_dy + dy[off + i]
                sum_dy_xc = sum_dy_xc + dy[off + i] * <double> (x[off + i] - mu_c)
        dbeta[c] += <floating> sum_dy
        dgamma[c] += <floating> (sum_dy_xc * invstd[c])
        scale = gamma[c] * invstd[c]
        if training:
            # dx = scale (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean)))
            mean_dy = <floating> (sum_dy / m)
            xc_coef = <floating> (sum_dy_xc * invstd[c] * invstd[c] / m)
            for n in range(N):
                off = (n * C + c) * HW
                for i in range(HW):
                    dx[off + i] = (dy[off + i] - mean_dy - (x[off + i] - mu_c) * xc_coef) * scale
        else:
            for n in range(N):
                off = (n * C + c) * HW
                for i in range(HW):
                    dx[off + i] = dy[off + i] * scale




cdef tuple _check_x(object x, object training, FloatKind* kind):
    """x validated, as (x, N, C, H*W); training must be a bool."""
    kind[0] = float_kind("x", x)
    xa = check_float("x", x, 4, kind[0])
    shape = (<object> xa).shape
    if (<object> xa).size == 0:
        raise ValueError(f"x: every dimension must be >= 1, got shape {shape}")
    if not isinstance(training, bool):
        raise TypeError(f"training: expected a bool, got {type(training).__name__}")
    return xa, shape[0], shape[1], shape[2] * shape[3]


cdef cnp.ndarray _check_channels(str name, object arr, FloatKind kind, Py_ssize_t C,
                                 bint output=False):
    a = check_float(name, arr, 1, kind, output)
    check_shape(name, a, (C,))
    return a


cdef object _check_outputs_disjoint(list outputs, list inputs):
    """No output overlaps an input or another output: kernels read after they write."""
    for k, (out_name, out) in enumerate(outputs):
        for in_name, other in inputs + outputs[k + 1:]:
            check_disjoint(out_name, out, in_name, other)


def batchnorm2d_forward(y, mean, invstd, x, gamma, beta, running_mean, running_var, training,
                        momentum=0.1, eps=1e-5):
    """y (N, C, H, W) = batch norm of x (N, C, H, W); per-channel arrays are all (C,).

    y, mean, invstd are overwritten with the output and the mean/invstd used (saved for
    backward). training=True normalizes with batch statistics and updates running_mean and
    running_var in place; training=False normalizes with them and leaves them untouched."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, training, &kind)
    if training and N * HW == 1:
        raise ValueError(f"x: expected more than 1 value per channel when training, "
                         f"got shape {(<object> xa).shape}")
    cdef double c_momentum = check_real("momentum", momentum)
    if not 0 <= c_momentum <= 1:
        raise ValueError(f"momentum: must be in [0, 1], got {momentum!r}")
    cdef double c_eps = check_real("eps", eps)
    if c_eps <= 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")
    ya = check_float("y", y, 4, kind, output=True)
    check_shape("y", ya, (<object> xa).shape)
    meana = _check_channels("mean", mean, kind, C, output=True)
    invstda = _check_channels("invstd", invstd, kind, C, output=True)
    gammaa = _check_channels("gamma", gamma, kind, C)
    betaa = _check_channels("beta", beta, kind, C)
    rmeana = _check_channels("running_mean", running_mean, kind, C, output=training)
    rvara = _check_channels("running_var", running_var, kind, C, output=training)
    outputs = [("y", ya), ("mean", meana), ("invstd", invstda)]
    inputs = [("x", xa), ("gamma", gammaa), ("beta", betaa)]
    running = [("running_mean", rmeana), ("running_var", rvara)]
    if training:
        _check_outputs_disjoint(outputs + running, inputs)
    else:
        _check_outputs_disjoint(outputs, inputs + running)
    cdef void* yp = data(ya)
    cdef void* meanp = data(meana)
    cdef void* invstdp = data(invstda)
    cdef void* rmeanp = data(rmeana)
    cdef void* rvarp = data(rvara)
    cdef void* xp = data(xa)
    cdef void* gammap = data(gammaa)
    cdef void* betap = data(betaa)
    cdef bint train = training
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _forward(<float*> yp, <float*> meanp, <float*> invstdp, <float*> rmeanp,
                     <float*> rvarp, <float*> xp, <float*> gammap, <float*> betap, train,
                     c_momentum, c_eps, n, c, hw)
        else:
            _forward(<double*> yp, <double*> meanp, <double*> invstdp, <double*> rmeanp,
                     <double*> rvarp, <double*> xp, <double*> gammap, <double*> betap, train,
                     c_momentum, c_eps, n, c, hw)


def batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, mean, invstd, training):
    """Gradients of batchnorm2d_forward given dy (N, C, H, W).

    dx (N, C, H, W) is overwritten; dgamma, dbeta (C,) are accumulated into (+=). mean and
    invstd (C,) are what forward returned; training must match the forward call."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, training, &kind)
    dya = check_float("dy", dy, 4, kind)
    check_shape("dy", dya, (<object> xa).shape)
    dxa = check_float("dx", dx, 4, kind, output=True)
    check_shape("dx", dxa, (<object> xa).shape)
    dgammaa = _check_channels("dgamma", dgamma, kind, C, output=True)
    dbetaa = _check_channels("dbeta", dbeta, kind, C, output=True)
    gammaa = _check_channels("gamma", gamma, kind, C)
    meana = _check_channels("mean", mean, kind, C)
    invstda = _check_channels("invstd", invstd, kind, C)
    _check_outputs_disjoint(
        [("dx", dxa), ("dgamma", dgammaa), ("dbeta", dbetaa)],
        [("dy", dya), ("x", xa), ("gamma", gammaa), ("mean", meana), ("invstd", invstda)])
    cdef void* dxp = data(dxa)
    cdef void* dgammap = data(dgammaa)
    cdef void* dbetap = data(dbetaa)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* gammap = data(gammaa)
    cdef void* meanp = data(meana)
    cdef void* invstdp = data(invstda)
    cdef bint train = training
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _backward(<float*> dxp, <float*> dgammap, <float*> dbetap, <float*> dyp,
                      <float*> xp, <float*> gammap, <float*> meanp, <float*> invstdp, train,
                      n, c, hw)
        else:
            _backward(<double*> dxp, <double*> dgammap, <double*> dbetap, <double*> dyp,
                      <double*> xp, <double*> gammap, <double*> meanp, <double*> invstdp,
                      train, n, c, hw)
