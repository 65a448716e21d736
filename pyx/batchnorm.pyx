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

Over a batch spread across processes (BatchNorm over the global batch, dynar/nn/batchnorm.py)
the same per-channel computations run split where the sums are taken, so that the caller can
add up every process's sums in between: batchnorm2d_shard_sums (a shard's statistics),
batchnorm2d_forward_with_statistics, batchnorm2d_gradient_sums, batchnorm2d_input_gradient.

Parallelism: prange over blocks of channels. A channel's sums stay in one thread in a fixed
order, so results are bitwise the same for every thread count.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport sqrt
cimport numpy as cnp

from _lane_sums cimport (LANES, MAX_BLOCK, channel_block, channel_sums, lanes_add,
                         lanes_total, lanes_zero)
from _parallel cimport threads_for
from _validate cimport check_real, F32, F64, FloatKind, check_disjoint, check_float, check_shape, data, float_kind

cnp.import_array()


# -- a block of channels (_lane_sums.channel_block) is a thread's unit of work: each image's
# part of it one contiguous read, each channel's sums in the order they take alone.

cdef inline void _add_squared_deviations(double* acc, const floating* run, double mu,
                                         Py_ssize_t length) noexcept nogil:
    """acc[i % LANES] += (run[i] - mu)^2 for i < length (in a local copy, as lanes_add)."""
    cdef double lane[LANES]
    cdef double dev
    cdef Py_ssize_t i, l, whole = length - length % LANES
    for l in range(LANES):
        lane[l] = acc[l]
    for i in range(whole // LANES):
        for l in range(LANES):
            dev = run[i * LANES + l] - mu
            lane[l] = lane[l] + dev * dev
    for l in range(length - whole):
        dev = run[whole + l] - mu
        lane[l] = lane[l] + dev * dev
    for l in range(LANES):
        acc[l] = lane[l]


cdef inline void _add_products(double* acc, const floating* dy, const floating* x, floating mu,
                               Py_ssize_t length) noexcept nogil:
    """acc[i % LANES] += dy[i] (x[i] - mu) for i < length (in a local copy, as lanes_add).
    Apart from sum(dy), which lanes_add takes: in one loop with it, the compiler leaves these
    products scalar."""
    cdef double lane[LANES]
    cdef Py_ssize_t i, j, l, whole = length - length % LANES
    for l in range(LANES):
        lane[l] = acc[l]
    for i in range(whole // LANES):
        for l in range(LANES):
            j = i * LANES + l
            lane[l] = lane[l] + dy[j] * <double> (x[j] - mu)
    for l in range(length - whole):
        lane[l] = lane[l] + dy[whole + l] * <double> (x[whole + l] - mu)
    for l in range(LANES):
        acc[l] = lane[l]


# -- the stages of a training step over the channels [c0, c1), paired forward and backward.
# Per-block outputs (sums, squares, sum_dy, sum_dy_xc) are indexed from c0.

cdef inline void _block_statistics(double* sums, double* squares, const floating* x,
                                   Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t N, Py_ssize_t C,
                                   Py_ssize_t HW) noexcept nogil:
    """sums, squares = each channel's sum over (N, H, W) and its squared deviations about its
    own mean: two passes, the block's values in cache between them."""
    cdef double acc[MAX_BLOCK * LANES]
    cdef Py_ssize_t n, c, k = c1 - c0
    cdef Py_ssize_t m = N * HW
    channel_sums(sums, x, c0, c1, N, C, HW)
    lanes_zero(acc, k * LANES)
    for n in range(N):
        for c in range(c0, c1):
            _add_squared_deviations(acc + (c - c0) * LANES, x + (n * C + c) * HW,
                                    sums[c - c0] / m, HW)
    for c in range(k):
        squares[c] = lanes_total(acc + c * LANES)


cdef inline void _channel_batch_statistics(floating* mean, floating* invstd,
                                           floating* running_mean, floating* running_var,
                                           double mu, double var, double m, double momentum,
                                           double eps, Py_ssize_t c) noexcept nogil:
    """The batch's mean and invstd for normalizing, and the running statistics' update,
    from the mean and (biased) variance of the channel's m values."""
    mean[c] = <floating> mu
    invstd[c] = <floating> (1 / sqrt(var + eps))
    running_mean[c] = <floating> ((1 - momentum) * running_mean[c] + momentum * mu)
    running_var[c] = <floating> ((1 - momentum) * running_var[c] + momentum * var * m / (m - 1))


cdef inline void _block_normalize(floating* y, const floating* x, const floating* mean,
                                  const floating* invstd, const floating* gamma,
                                  const floating* beta, Py_ssize_t c0, Py_ssize_t c1,
                                  Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    # With the rounded mean/invstd that backward will be given.
    cdef floating mu_c, scale, shift
    cdef const floating* xc
    cdef floating* yc
    cdef Py_ssize_t n, c, i
    for n in range(N):
        for c in range(c0, c1):
            mu_c = mean[c]
            scale = invstd[c] * gamma[c]
            shift = beta[c]
            xc = x + (n * C + c) * HW
            yc = y + (n * C + c) * HW
            for i in range(HW):
                yc[i] = (xc[i] - mu_c) * scale + shift


cdef inline void _block_gradient_sums(double* sum_dy, double* sum_dy_xc, floating* dgamma,
                                      floating* dbeta, const floating* dy, const floating* x,
                                      const floating* mean, const floating* invstd,
                                      Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t N,
                                      Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """sum_dy, sum_dy_xc = each channel's sum(dy) and sum(dy (x - mean)) (the latter times
    invstd is sum(dy xhat)); dbeta, dgamma (indexed by channel) += the parameter gradients
    they give."""
    cdef double acc_dy[MAX_BLOCK * LANES]
    cdef double acc_dy_xc[MAX_BLOCK * LANES]
    cdef Py_ssize_t n, c, off, k = c1 - c0
    lanes_zero(acc_dy, k * LANES)
    lanes_zero(acc_dy_xc, k * LANES)
    for n in range(N):
        for c in range(c0, c1):
            off = (n * C + c) * HW
            lanes_add(acc_dy + (c - c0) * LANES, dy + off, HW)
            _add_products(acc_dy_xc + (c - c0) * LANES, dy + off, x + off, mean[c], HW)
    for c in range(c0, c1):
        sum_dy[c - c0] = lanes_total(acc_dy + (c - c0) * LANES)
        sum_dy_xc[c - c0] = lanes_total(acc_dy_xc + (c - c0) * LANES)
        dbeta[c] += <floating> sum_dy[c - c0]
        dgamma[c] += <floating> (sum_dy_xc[c - c0] * invstd[c])


cdef inline void _block_input_gradient(floating* dx, const floating* dy, const floating* x,
                                       const floating* gamma, const floating* mean,
                                       const floating* invstd, const double* sum_dy,
                                       const double* sum_dy_xc, double m, bint training,
                                       Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t N,
                                       Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """dx from the channels' sums over the m values they were taken over."""
    cdef floating scale[MAX_BLOCK]
    cdef floating mean_dy[MAX_BLOCK]
    cdef floating xc_coef[MAX_BLOCK]
    cdef floating mu_c
    cdef Py_ssize_t n, c, i, k, off
    for c in range(c0, c1):
        k = c - c0
        scale[k] = gamma[c] * invstd[c]
        # training: dx = scale (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean)))
        mean_dy[k] = <floating> (sum_dy[k] / m)
        xc_coef[k] = <floating> (sum_dy_xc[k] * invstd[c] * invstd[c] / m)
    for n in range(N):
        for c in range(c0, c1):
            k = c - c0
            off = (n * C + c) * HW
            if training:
                mu_c = mean[c]
                for i in range(HW):
                    dx[off + i] = (dy[off + i] - mean_dy[k] - (x[off + i] - mu_c) * xc_coef[k]) \
                        * scale[k]
            else:
                for i in range(HW):
                    dx[off + i] = dy[off + i] * scale[k]


# -- the kernels: prange over blocks.

cdef inline void _forward_block(floating* y, floating* mean, floating* invstd,
                                floating* running_mean, floating* running_var,
                                const floating* x, const floating* gamma, const floating* beta,
                                bint training, double momentum, double eps, Py_ssize_t c0,
                                Py_ssize_t c1, Py_ssize_t N, Py_ssize_t C,
                                Py_ssize_t HW) noexcept nogil:
    cdef double sums[MAX_BLOCK]
    cdef double squares[MAX_BLOCK]
    cdef Py_ssize_t c, m = N * HW
    if training:
        _block_statistics(sums, squares, x, c0, c1, N, C, HW)
        for c in range(c0, c1):
            _channel_batch_statistics(mean, invstd, running_mean, running_var,
                                      sums[c - c0] / m, squares[c - c0] / m, m, momentum,
                                      eps, c)
    else:
        for c in range(c0, c1):
            mean[c] = running_mean[c]
            invstd[c] = <floating> (1 / sqrt(running_var[c] + eps))
    _block_normalize(y, x, mean, invstd, gamma, beta, c0, c1, N, C, HW)


cdef void _forward(floating* y, floating* mean, floating* invstd, floating* running_mean,
                   floating* running_var, const floating* x, const floating* gamma,
                   const floating* beta, bint training, double momentum, double eps,
                   Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """y, x: (N, C, HW); mean, invstd, running_mean, running_var, gamma, beta: (C,)."""
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _forward_block(y, mean, invstd, running_mean, running_var, x, gamma, beta, training,
                       momentum, eps, c0, min(c0 + block, C), N, C, HW)


cdef void _shard_sums(double* sums, double* squares, const floating* x, Py_ssize_t N,
                      Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """sums, squares (C,) = _forward's statistics passes over a shard: the sum and the
    squared deviations about the shard's own mean."""
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _block_statistics(sums + c0, squares + c0, x, c0, min(c0 + block, C), N, C, HW)


cdef inline void _forward_with_statistics_block(
        floating* y, floating* mean, floating* invstd, floating* running_mean,
        floating* running_var, const floating* x, const floating* gamma, const floating* beta,
        const double* batch_mean, const double* batch_var, double count, double momentum,
        double eps, Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t N, Py_ssize_t C,
        Py_ssize_t HW) noexcept nogil:
    cdef Py_ssize_t c
    for c in range(c0, c1):
        _channel_batch_statistics(mean, invstd, running_mean, running_var, batch_mean[c],
                                  batch_var[c], count, momentum, eps, c)
    _block_normalize(y, x, mean, invstd, gamma, beta, c0, c1, N, C, HW)


cdef void _forward_with_statistics(floating* y, floating* mean, floating* invstd,
                                   floating* running_mean, floating* running_var,
                                   const floating* x, const floating* gamma,
                                   const floating* beta, const double* batch_mean,
                                   const double* batch_var, double count, double momentum,
                                   double eps, Py_ssize_t N, Py_ssize_t C,
                                   Py_ssize_t HW) noexcept nogil:
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _forward_with_statistics_block(y, mean, invstd, running_mean, running_var, x, gamma,
                                       beta, batch_mean, batch_var, count, momentum, eps, c0,
                                       min(c0 + block, C), N, C, HW)


cdef inline void _backward_block(floating* dx, floating* dgamma, floating* dbeta,
                                 const floating* dy, const floating* x, const floating* gamma,
                                 const floating* mean, const floating* invstd, bint training,
                                 Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t N, Py_ssize_t C,
                                 Py_ssize_t HW) noexcept nogil:
    cdef double sum_dy[MAX_BLOCK]
    cdef double sum_dy_xc[MAX_BLOCK]
    _block_gradient_sums(sum_dy, sum_dy_xc, dgamma, dbeta, dy, x, mean, invstd, c0, c1, N, C,
                         HW)
    _block_input_gradient(dx, dy, x, gamma, mean, invstd, sum_dy, sum_dy_xc, N * HW, training,
                          c0, c1, N, C, HW)


cdef void _backward(floating* dx, floating* dgamma, floating* dbeta, const floating* dy,
                    const floating* x, const floating* gamma, const floating* mean,
                    const floating* invstd, bint training,
                    Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """dx, dy, x: (N, C, HW); dgamma, dbeta, gamma, mean, invstd: (C,)."""
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _backward_block(dx, dgamma, dbeta, dy, x, gamma, mean, invstd, training, c0,
                        min(c0 + block, C), N, C, HW)


cdef void _gradient_sums(double* sums, floating* dgamma, floating* dbeta, const floating* dy,
                         const floating* x, const floating* mean, const floating* invstd,
                         Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """sums (2, C): _backward's per-channel sums, which it also adds to dgamma, dbeta."""
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _block_gradient_sums(sums + c0, sums + C + c0, dgamma, dbeta, dy, x, mean, invstd, c0,
                             min(c0 + block, C), N, C, HW)


cdef void _input_gradient(floating* dx, const floating* dy, const floating* x,
                          const floating* gamma, const floating* mean, const floating* invstd,
                          const double* sums, double count, Py_ssize_t N, Py_ssize_t C,
                          Py_ssize_t HW) noexcept nogil:
    cdef Py_ssize_t block = channel_block(C, HW, threads_for(C))
    cdef Py_ssize_t blocks = (C + block - 1) // block
    cdef Py_ssize_t b, c0
    for b in prange(blocks, schedule="static", num_threads=threads_for(blocks)):
        c0 = b * block
        _block_input_gradient(dx, dy, x, gamma, mean, invstd, sums + c0, sums + C + c0, count,
                              True, c0, min(c0 + block, C), N, C, HW)


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


cdef object _check_momentum_eps(object momentum, object eps, double* c_momentum,
                               double* c_eps):
    c_momentum[0] = check_real("momentum", momentum)
    if not 0 <= c_momentum[0] <= 1:
        raise ValueError(f"momentum: must be in [0, 1], got {momentum!r}")
    c_eps[0] = check_real("eps", eps)
    if c_eps[0] <= 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")


cdef double _check_count(object count) except -1:
    cdef double c = check_real("count", count)
    if not c > 1:
        raise ValueError(f"count: expected more than 1 value per channel when training, "
                         f"got {count!r}")
    return c


cdef cnp.ndarray _check_sums(str name, object arr, tuple shape, bint output=False):
    a = check_float(name, arr, len(shape), F64, output)
    check_shape(name, a, shape)
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
    cdef double c_momentum, c_eps
    _check_momentum_eps(momentum, eps, &c_momentum, &c_eps)
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


# -- the same computations split where a training step sums over the batch, for BatchNorm
# over a batch spread across processes: the caller adds each process's sums up in between.

def batchnorm2d_shard_sums(sums, squares, x):
    """sums, squares (C,) float64 = per channel of x (N, C, H, W), a shard of a batch, the
    sum over (N, H, W) and the squared deviations about the shard's own mean sum / (N H W):
    the two passes of a training forward's statistics, which the caller combines over the
    shards (dynar.nn.batchnorm.batch_statistics)."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, True, &kind)
    sumsa = _check_sums("sums", sums, (C,), output=True)
    squaresa = _check_sums("squares", squares, (C,), output=True)
    _check_outputs_disjoint([("sums", sumsa), ("squares", squaresa)], [("x", xa)])
    cdef double* sp = <double*> data(sumsa)
    cdef double* qp = <double*> data(squaresa)
    cdef void* xp = data(xa)
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _shard_sums(sp, qp, <float*> xp, n, c, hw)
        else:
            _shard_sums(sp, qp, <double*> xp, n, c, hw)


def batchnorm2d_forward_with_statistics(y, mean, invstd, x, gamma, beta, running_mean,
                                        running_var, batch_mean, batch_var, count,
                                        momentum=0.1, eps=1e-5):
    """batchnorm2d_forward in training, with the batch statistics given: batch_mean and
    batch_var (C,) float64, the mean and biased variance of `count` values per channel (more
    than x's own N*H*W when the batch spans processes)."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, True, &kind)
    cdef double c_momentum, c_eps
    _check_momentum_eps(momentum, eps, &c_momentum, &c_eps)
    cdef double c_count = _check_count(count)
    ya = check_float("y", y, 4, kind, output=True)
    check_shape("y", ya, (<object> xa).shape)
    meana = _check_channels("mean", mean, kind, C, output=True)
    invstda = _check_channels("invstd", invstd, kind, C, output=True)
    gammaa = _check_channels("gamma", gamma, kind, C)
    betaa = _check_channels("beta", beta, kind, C)
    rmeana = _check_channels("running_mean", running_mean, kind, C, output=True)
    rvara = _check_channels("running_var", running_var, kind, C, output=True)
    bmeana = _check_sums("batch_mean", batch_mean, (C,))
    bvara = _check_sums("batch_var", batch_var, (C,))
    _check_outputs_disjoint(
        [("y", ya), ("mean", meana), ("invstd", invstda), ("running_mean", rmeana),
         ("running_var", rvara)],
        [("x", xa), ("gamma", gammaa), ("beta", betaa), ("batch_mean", bmeana),
         ("batch_var", bvara)])
    cdef void* yp = data(ya)
    cdef void* meanp = data(meana)
    cdef void* invstdp = data(invstda)
    cdef void* rmeanp = data(rmeana)
    cdef void* rvarp = data(rvara)
    cdef void* xp = data(xa)
    cdef void* gammap = data(gammaa)
    cdef void* betap = data(betaa)
    cdef const double* bmp = <const double*> data(bmeana)
    cdef const double* bvp = <const double*> data(bvara)
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _forward_with_statistics(<float*> yp, <float*> meanp, <float*> invstdp,
                                     <float*> rmeanp, <float*> rvarp, <float*> xp,
                                     <float*> gammap, <float*> betap, bmp, bvp, c_count,
                                     c_momentum, c_eps, n, c, hw)
        else:
            _forward_with_statistics(<double*> yp, <double*> meanp, <double*> invstdp,
                                     <double*> rmeanp, <double*> rvarp, <double*> xp,
                                     <double*> gammap, <double*> betap, bmp, bvp, c_count,
                                     c_momentum, c_eps, n, c, hw)


def batchnorm2d_gradient_sums(sums, dgamma, dbeta, dy, x, mean, invstd):
    """sums (2, C) float64 = per channel sum(dy) and sum(dy (x - mean)) over (N, H, W): the
    reductions of a training backward; dgamma, dbeta (C,) += the parameter gradients they
    give for this x (accumulated, as batchnorm2d_backward)."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, True, &kind)
    dya = check_float("dy", dy, 4, kind)
    check_shape("dy", dya, (<object> xa).shape)
    sumsa = _check_sums("sums", sums, (2, C), output=True)
    dgammaa = _check_channels("dgamma", dgamma, kind, C, output=True)
    dbetaa = _check_channels("dbeta", dbeta, kind, C, output=True)
    meana = _check_channels("mean", mean, kind, C)
    invstda = _check_channels("invstd", invstd, kind, C)
    _check_outputs_disjoint(
        [("sums", sumsa), ("dgamma", dgammaa), ("dbeta", dbetaa)],
        [("dy", dya), ("x", xa), ("mean", meana), ("invstd", invstda)])
    cdef double* sp = <double*> data(sumsa)
    cdef void* dgammap = data(dgammaa)
    cdef void* dbetap = data(dbetaa)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* meanp = data(meana)
    cdef void* invstdp = data(invstda)
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _gradient_sums(sp, <float*> dgammap, <float*> dbetap, <float*> dyp, <float*> xp,
                           <float*> meanp, <float*> invstdp, n, c, hw)
        else:
            _gradient_sums(sp, <double*> dgammap, <double*> dbetap, <double*> dyp,
                           <double*> xp, <double*> meanp, <double*> invstdp, n, c, hw)


def batchnorm2d_input_gradient(dx, dy, x, gamma, mean, invstd, sums, count):
    """dx (N, C, H, W) of a training backward, overwritten, from sums (2, C) float64 (as
    batchnorm2d_gradient_sums gives them, possibly added up over processes) of `count` values
    per channel."""
    cdef FloatKind kind
    xa, N, C, HW = _check_x(x, True, &kind)
    cdef double c_count = _check_count(count)
    dya = check_float("dy", dy, 4, kind)
    check_shape("dy", dya, (<object> xa).shape)
    dxa = check_float("dx", dx, 4, kind, output=True)
    check_shape("dx", dxa, (<object> xa).shape)
    gammaa = _check_channels("gamma", gamma, kind, C)
    meana = _check_channels("mean", mean, kind, C)
    invstda = _check_channels("invstd", invstd, kind, C)
    sumsa = _check_sums("sums", sums, (2, C))
    _check_outputs_disjoint(
        [("dx", dxa)],
        [("dy", dya), ("x", xa), ("gamma", gammaa), ("mean", meana), ("invstd", invstda),
         ("sums", sumsa)])
    cdef void* dxp = data(dxa)
    cdef void* dyp = data(dya)
    cdef void* xp = data(xa)
    cdef void* gammap = data(gammaa)
    cdef void* meanp = data(meana)
    cdef void* invstdp = data(invstda)
    cdef const double* sp = <const double*> data(sumsa)
    cdef Py_ssize_t n = N, c = C, hw = HW
    with nogil:
        if kind == F32:
            _input_gradient(<float*> dxp, <float*> dyp, <float*> xp, <float*> gammap,
                            <float*> meanp, <float*> invstdp, sp, c_count, n, c, hw)
        else:
            _input_gradient(<double*> dxp, <double*> dyp, <double*> xp, <double*> gammap,
                            <double*> meanp, <double*> invstdp, sp, c_count, n, c, hw)
