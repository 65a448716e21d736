import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import batchnorm
from dynar.nn.batchnorm import batch_statistics, group_sum_sizes, shard_statistics
from gradcheck import assert_gradient
from support import at_thread_counts, require_torch
from support.bad_inputs import as_real, float_dtype, is_array, overlap, run_spoiled, spoiled_calls

# (N, C, H, W): batch 1 with spatial extent, 1x1 maps with a batch, a single channel.
GRAD_CASES = [(2, 3, 2, 2), (1, 2, 3, 1), (4, 1, 1, 1), (3, 2, 2, 3)]


class Stats:
    """Copies of the running statistics, and the per-channel arrays forward fills."""

    def __init__(self, running_mean, running_var):
        self.running_mean = running_mean.copy()
        self.running_var = running_var.copy()
        self.mean = np.empty_like(running_mean)
        self.invstd = np.empty_like(running_mean)


def _random_stats(rng, C, dtype):
    return Stats(rng.standard_normal(C).astype(dtype), rng.uniform(0.5, 2.0, C).astype(dtype))


def _forward(x, gamma, beta, stats, training, momentum=0.1, eps=1e-5):
    y = np.empty_like(x)
    batchnorm.batchnorm2d_forward(y, stats.mean, stats.invstd, x, gamma, beta,
                                  stats.running_mean, stats.running_var, training, momentum, eps)
    return y


def _backward(dy, x, gamma, stats, training):
    dx = np.empty_like(x)
    dgamma = np.zeros_like(gamma)
    dbeta = np.zeros_like(gamma)
    batchnorm.batchnorm2d_backward(dx, dgamma, dbeta, dy, x, gamma, stats.mean, stats.invstd,
                                   training)
    return dx, dgamma, dbeta


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_batchnorm_gradients_match_central_differences(case, training, rng):
    N, C, H, W = case
    x = rng.standard_normal((N, C, H, W))
    gamma = rng.standard_normal(C)
    beta = rng.standard_normal(C)
    running = (rng.standard_normal(C), rng.uniform(0.5, 2.0, C))
    proj = rng.standard_normal(x.shape)

    def loss():
        # Fresh running statistics each call: training updates them in place.
        return float(np.sum(_forward(x, gamma, beta, Stats(*running), training) * proj))

    stats = Stats(*running)
    _forward(x, gamma, beta, stats, training)
    dx, dgamma, dbeta = _backward(proj, x, gamma, stats, training)
    assert_gradient("x", dx, loss, x)
    assert_gradient("gamma", dgamma, loss, gamma)
    assert_gradient("beta", dbeta, loss, beta)


def test_batchnorm_backward_accumulates_parameter_gradients(rng):
    x = rng.standard_normal((3, 2, 4, 4))
    gamma = rng.standard_normal(2)
    stats = _random_stats(rng, 2, np.float64)
    _forward(x, gamma, np.zeros(2), stats, True)
    dy = rng.standard_normal(x.shape)
    _, dgamma, dbeta = _backward(dy, x, gamma, stats, True)
    dgamma2, dbeta2 = np.ones(2), np.ones(2)
    batchnorm.batchnorm2d_backward(np.empty_like(x), dgamma2, dbeta2, dy, x, gamma, stats.mean,
                                   stats.invstd, True)
    np.testing.assert_allclose(dgamma2, dgamma + 1, rtol=1e-12)
    np.testing.assert_allclose(dbeta2, dbeta + 1, rtol=1e-12)


def test_batchnorm_statistics_are_accurate_in_float32_far_from_zero(rng):
    # |mean| / std = 1e4: a float32 E[x^2] - E[x]^2 would cancel to noise (or go negative).
    x = (1e4 + rng.standard_normal((8, 3, 5, 5))).astype(np.float32)
    stats = _random_stats(rng, 3, np.float32)
    _forward(x, np.ones(3, np.float32), np.zeros(3, np.float32), stats, True, eps=1e-5)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3))
    invstd = 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5)
    np.testing.assert_allclose(stats.mean, mean, rtol=1e-7)
    np.testing.assert_allclose(stats.invstd, invstd, rtol=1e-6)


def test_batchnorm_eval_leaves_running_statistics_untouched(rng):
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    stats = _random_stats(rng, 3, np.float32)
    saved_mean, saved_var = stats.running_mean.copy(), stats.running_var.copy()
    stats.running_mean.flags.writeable = False     # eval only reads them
    stats.running_var.flags.writeable = False
    gamma = rng.standard_normal(3).astype(np.float32)
    beta = rng.standard_normal(3).astype(np.float32)
    y = _forward(x, gamma, beta, stats, False)
    np.testing.assert_array_equal(stats.running_mean, saved_mean)
    np.testing.assert_array_equal(stats.running_var, saved_var)
    np.testing.assert_array_equal(stats.mean, saved_mean)
    np.testing.assert_allclose(stats.invstd, 1 / np.sqrt(saved_var.astype(np.float64) + 1e-5),
                               rtol=1e-6)
    expected = ((x - saved_mean[:, None, None]) * (stats.invstd * gamma)[:, None, None]
                + beta[:, None, None])
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="read-only"):
        _forward(x, gamma, beta, stats, True)


def test_batchnorm_training_needs_more_than_one_value_per_channel(rng):
    x = rng.standard_normal((1, 3, 1, 1))
    stats = _random_stats(rng, 3, np.float64)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        _forward(x, np.ones(3), np.zeros(3), stats, True)
    _forward(x, np.ones(3), np.zeros(3), stats, False)   # eval uses running stats: fine


def _random_parity_cases(count, seed=11):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        N, C, H, W = (int(v) for v in rng.integers(1, [9, 9, 8, 8]))
        if N * H * W < 2:
            continue
        cases.append((N, C, H, W, float(rng.choice([0.1, 0.3, 1.0, 0.0])),
                      float(rng.choice([1e-5, 1e-3])), float(rng.uniform(-5, 5)),
                      float(rng.uniform(0.1, 3))))
    return cases


# The last: more channels than a block of them takes (64) on small maps.
@pytest.mark.parametrize("case", _random_parity_cases(20) + [(3, 70, 2, 3, 0.1, 1e-5, 1.0, 1.0)])
def test_batchnorm_float32_matches_pytorch_over_several_steps(case, rng):
    torch = require_torch()
    N, C, H, W, momentum, eps, offset, spread = case
    ref = torch.nn.BatchNorm2d(C, eps=eps, momentum=momentum)
    gamma = rng.uniform(0.5, 2, C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(gamma))
        ref.bias.copy_(torch.tensor(beta))
    stats = Stats(np.zeros(C, np.float32), np.ones(C, np.float32))   # torch's initial values
    # float32 with differently ordered sums over N*H*W <= 392 values: relative 1e-4 on the
    # O(1) normalized values, looser absolute tolerance on the summed parameter gradients.
    tol = dict(rtol=1e-4, atol=1e-4)
    for training in (True, True, True, False):
        ref.train(training)
        x = (offset + spread * rng.standard_normal((N, C, H, W))).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(np.float32)
        xt = torch.tensor(x, requires_grad=True)
        ref.zero_grad()
        yt = ref(xt)
        yt.backward(torch.tensor(dy))
        y = _forward(x, gamma, beta, stats, training, momentum, eps)
        dx, dgamma, dbeta = _backward(dy, x, gamma, stats, training)
        np.testing.assert_allclose(y, yt.detach().numpy(), **tol)
        # dx scales as 1/spread: compare it normalized to O(1).
        np.testing.assert_allclose(dx * spread, xt.grad.numpy() * spread, **tol)
        np.testing.assert_allclose(dgamma, ref.weight.grad.numpy(), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(dbeta, ref.bias.grad.numpy(), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(stats.running_mean, ref.running_mean.numpy(),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.running_var, ref.running_var.numpy(),
                                   rtol=1e-5, atol=1e-6)


# (3, 70, 2, 3): more channels than a block takes (64), blocks of 64 + 6 on one thread and
# 35 + 35 on two.
@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (3, 70, 2, 3)])
def test_batchnorm_thread_count_one_vs_two_is_bitwise(shape, rng):
    C = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.standard_normal(C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)

    def run(training):
        stats = _random_stats(np.random.default_rng(3), C, np.float32)
        y = _forward(x, gamma, beta, stats, training)
        return (y, stats.mean, stats.invstd, stats.running_mean, stats.running_var,
                *_backward(dy, x, gamma, stats, training))

    for training in (True, False):
        one, two = at_thread_counts(lambda: run(training))
        # Every sum belongs to one channel, which one thread computes in a fixed order
        # whatever the blocks of channels the threads take.
        for a, b in zip(one, two):
            np.testing.assert_array_equal(a, b)


def test_batchnorm_errors_name_the_argument(rng):
    x = np.zeros((2, 3, 4, 4), np.float32)
    c = np.zeros(3, np.float32)
    s = _random_stats(rng, 3, np.float32)
    with pytest.raises(TypeError, match="^x"):
        _forward(x.astype(np.float16), c, c, s, True)
    with pytest.raises(TypeError, match="^gamma"):
        _forward(x, c.astype(np.float64), c, s, True)
    with pytest.raises(ValueError, match="^beta"):
        _forward(x, c, np.zeros(4, np.float32), s, True)
    with pytest.raises(ValueError, match="^x: every dimension"):
        _forward(np.zeros((2, 3, 0, 4), np.float32), c, c, s, True)
    with pytest.raises(TypeError, match="^training"):
        _forward(x, c, c, s, 1)
    with pytest.raises(ValueError, match="^momentum"):
        _forward(x, c, c, s, True, momentum=1.5)
    with pytest.raises(TypeError, match="^momentum"):
        _forward(x, c, c, s, True, momentum=None)
    with pytest.raises(ValueError, match="^eps"):
        _forward(x, c, c, s, True, eps=0.0)
    with pytest.raises(ValueError, match="^eps"):
        _forward(x, c, c, s, True, eps=float("nan"))
    with pytest.raises(ValueError, match="overlap"):
        batchnorm.batchnorm2d_forward(np.empty_like(x), c, s.invstd, x, c, c,
                                      s.running_mean, s.running_var, True)
    with pytest.raises(ValueError, match="^dy"):
        batchnorm.batchnorm2d_backward(np.empty_like(x), c.copy(), c.copy(),
                                       np.zeros((2, 3, 4, 5), np.float32), x, c, c, c, True)
    with pytest.raises(ValueError, match="^invstd"):
        batchnorm.batchnorm2d_backward(np.empty_like(x), c.copy(), c.copy(), x.copy(), x, c, c,
                                       c[:2], True)


def _valid_args(backward, training):
    """A valid float32 call of batchnorm2d_backward (or _forward), every argument by name: x
    (2, 3, 2, 2), random values, positive running variances."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3, 2, 2)), rng.standard_normal((2, 3, 2, 2))
    gamma, beta, mean = rng.standard_normal(3), rng.standard_normal(3), rng.standard_normal(3)
    invstd, var = rng.uniform(0.5, 2.0, 3), rng.uniform(0.5, 2.0, 3)
    if backward:
        args = dict(dx=np.zeros_like(x), dgamma=rng.standard_normal(3), dbeta=beta, dy=dy, x=x,
                    gamma=gamma, mean=mean, invstd=invstd)
    else:
        args = dict(y=np.zeros_like(x), mean=np.zeros(3), invstd=np.zeros(3), x=x, gamma=gamma,
                    beta=beta, running_mean=mean, running_var=var)
    args = {name: value.astype(np.float32) for name, value in args.items()}
    args["training"] = training
    if not backward:
        args.update(momentum=0.1, eps=1e-5)
    return args


def _accepts(args):
    """Whether batchnorm2d_forward/backward must compute `args` (else refuse them), decided
    from the arguments: x a non-empty (N, C, H, W) float array, training a bool; the other
    arrays of x's dtype, x's shape or (C,), C-contiguous and aligned; outputs (the running
    statistics too, when training) writeable and sharing no memory with another argument.
    Forward: more than one value per channel when training, momentum in [0, 1], eps > 0."""
    x, training = args["x"], args["training"]
    dtype = float_dtype(x)
    if not is_array(x, dtype, ndim=4) or x.size == 0 or not isinstance(training, bool):
        return False
    if "momentum" in args:
        momentum, eps = as_real(args["momentum"]), as_real(args["eps"])
        if training and x.size // x.shape[1] == 1 or momentum is None or not 0 <= momentum <= 1 \
                or eps is None or not 0 < eps < math.inf:
            return False
        written = {"y", "mean", "invstd"} | ({"running_mean", "running_var"} if training else set())
    else:
        written = {"dx", "dgamma", "dbeta"}
    arrays = [name for name in args if name not in ("training", "momentum", "eps")]
    shapes = {name: x.shape if name in ("x", "y", "dx", "dy") else x.shape[1:2] for name in arrays}
    return all(is_array(args[name], dtype, shapes[name], output=name in written)
               for name in arrays) and not overlap(args, written)


def _assert_computed(before, args):
    """The outputs in `args` after the call follow the formulas of pyx/batchnorm.pyx from
    `before`'s inputs (in float64; float32 rounding of mean and invstd allowed for)."""
    def close(got, want):
        scale = max(1.0, float(np.nanmax(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)

    c = lambda v: np.asarray(v, np.float64).reshape(1, -1, 1, 1)   # noqa: E731 - per channel
    x = before["x"].astype(np.float64)
    m = x.size // x.shape[1]
    if "y" in args:
        if args["training"]:
            mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
            momentum = as_real(args["momentum"])
            close(args["running_mean"], (1 - momentum) * before["running_mean"] + momentum * mean)
            close(args["running_var"],
                  (1 - momentum) * before["running_var"] + momentum * var * m / (m - 1))
        else:
            mean, var = before["running_mean"], before["running_var"]
            np.testing.assert_array_equal(args["running_mean"], before["running_mean"])
            np.testing.assert_array_equal(args["running_var"], before["running_var"])
        invstd = 1 / np.sqrt(var.astype(np.float64) + as_real(args["eps"]))
        close(args["mean"], mean)
        close(args["invstd"], invstd)
        close(args["y"], (x - c(mean)) * c(invstd) * c(before["gamma"]) + c(before["beta"]))
        return
    dy, invstd = before["dy"].astype(np.float64), c(before["invstd"])
    xhat = (x - c(before["mean"])) * invstd
    sum_dy, sum_dy_xhat = dy.sum(axis=(0, 2, 3)), (dy * xhat).sum(axis=(0, 2, 3))
    close(args["dbeta"], before["dbeta"] + sum_dy)
    close(args["dgamma"], before["dgamma"] + sum_dy_xhat)
    if args["training"]:
        dy = dy - c(sum_dy) / m - xhat * c(sum_dy_xhat) / m
    close(args["dx"], c(before["gamma"]) * invstd * dy)


@settings(max_examples=300, deadline=None)
@given(backward=st.booleans(), training=st.booleans(), data=st.data())
def test_batchnorm_bad_input_always_raises_a_python_exception(backward, training, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # a read-only input, another momentum or eps), the others must be refused.
    args = data.draw(spoiled_calls(_valid_args(backward, training),
                                   values={"momentum": st.floats(0, 1),
                                           "eps": st.floats(1e-8, 1.0)}))
    call = batchnorm.batchnorm2d_backward if backward else batchnorm.batchnorm2d_forward
    ran = run_spoiled(call, args, _accepts(args))
    if ran:
        _assert_computed(ran[0], args)


# -- split where the sums are taken: BatchNorm over a batch spread across processes --------

def _split_forward(shards, gamma, beta, stats, momentum=0.1, eps=1e-5):
    """The split kernels over `shards` of one batch as separate processes would run them
    (nn.BatchNorm2d's protocol), the sums added up in shard order; `stats` holds the running statistics every process
    shares. Returns (y of each shard, mean, invstd, count)."""
    C = gamma.size
    per_shard = [shard_statistics(s, np.empty(group_sum_sizes(C)[0])) for s in shards]
    mean, var, count = batch_statistics(np.sum(per_shard, axis=0))
    ys, running = [], None
    for s in shards:
        # every process updates the same running statistics from the same figures
        mine = Stats(stats.running_mean, stats.running_var)
        y = np.empty_like(s)
        batchnorm.batchnorm2d_forward_with_statistics(y, mine.mean, mine.invstd, s, gamma, beta,
                                                      mine.running_mean, mine.running_var,
                                                      mean, var, count, momentum, eps)
        ys.append(y)
        if running is not None:
            np.testing.assert_array_equal(mine.running_mean, running.running_mean)
        running = mine
    stats.running_mean[:], stats.running_var[:] = running.running_mean, running.running_var
    return ys, running.mean, running.invstd, count


def _split_backward(dys, shards, gamma, mean, invstd, count):
    C = gamma.size
    sums, dgammas, dbetas = [], [], []
    for dy, s in zip(dys, shards):
        part = np.empty((2, C))
        dgamma, dbeta = np.zeros_like(gamma), np.zeros_like(gamma)
        batchnorm.batchnorm2d_gradient_sums(part, dgamma, dbeta, dy, s, mean, invstd)
        sums.append(part)
        dgammas.append(dgamma)
        dbetas.append(dbeta)
    total = np.sum(sums, axis=0)
    dxs = []
    for dy, s in zip(dys, shards):
        dx = np.empty_like(s)
        batchnorm.batchnorm2d_input_gradient(dx, dy, s, gamma, mean, invstd, total, count)
        dxs.append(dx)
    return dxs, np.sum(dgammas, axis=0), np.sum(dbetas, axis=0)


@pytest.mark.parametrize("shape", [(4, 5, 3, 3), (3, 70, 2, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_kernels_over_one_shard_are_the_fused_kernels_bitwise(dtype, shape, rng):
    C = shape[1]
    x = (3 + rng.standard_normal(shape)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    gamma, beta = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    fused, split = _random_stats(rng, C, dtype), None
    split = Stats(fused.running_mean, fused.running_var)
    y = _forward(x, gamma, beta, fused, True)
    (y_split,), mean, invstd, count = _split_forward([x], gamma, beta, split)
    for a, b in ((y, y_split), (fused.mean, mean), (fused.invstd, invstd),
                 (fused.running_mean, split.running_mean), (fused.running_var, split.running_var)):
        np.testing.assert_array_equal(a, b)
    dx, dgamma, dbeta = _backward(dy, x, gamma, fused, True)
    (dx_split,), dgamma_split, dbeta_split = _split_backward([dy], [x], gamma, mean, invstd, count)
    for a, b in ((dx, dx_split), (dgamma, dgamma_split), (dbeta, dbeta_split)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sizes", [(3, 1), (2, 2, 2), (1, 4)])
def test_split_kernels_over_shards_equal_one_batch(sizes, rng):
    # float64: only the order of the shards' sums differs from the whole batch's
    x = 2 + rng.standard_normal((sum(sizes), 3, 2, 3))
    dy = rng.standard_normal(x.shape)
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    whole = _random_stats(rng, 3, np.float64)
    spread = Stats(whole.running_mean, whole.running_var)
    cuts = np.cumsum(sizes)[:-1]
    y = _forward(x, gamma, beta, whole, True)
    ys, mean, invstd, count = _split_forward(np.split(x, cuts), gamma, beta, spread)
    assert count == x.size // 3
    tight = dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(ys), y, **tight)
    np.testing.assert_allclose(spread.running_mean, whole.running_mean, **tight)
    np.testing.assert_allclose(spread.running_var, whole.running_var, **tight)
    dx, dgamma, dbeta = _backward(dy, x, gamma, whole, True)
    dxs, dgamma_split, dbeta_split = _split_backward(np.split(dy, cuts), np.split(x, cuts),
                                                     gamma, mean, invstd, count)
    np.testing.assert_allclose(np.concatenate(dxs), dx, **tight)
    np.testing.assert_allclose(dgamma_split, dgamma, **tight)
    np.testing.assert_allclose(dbeta_split, dbeta, **tight)


def test_split_kernels_name_a_bad_argument(rng):
    x = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)
    c, c64 = np.zeros(3, np.float32), np.zeros(3)
    with pytest.raises(TypeError, match="^sums"):
        batchnorm.batchnorm2d_shard_sums(np.zeros(3, np.float32), c64.copy(), x)
    with pytest.raises(ValueError, match="^squares"):
        batchnorm.batchnorm2d_shard_sums(c64.copy(), np.zeros(4), x)
    with pytest.raises(ValueError, match="^count: expected more than 1"):
        batchnorm.batchnorm2d_forward_with_statistics(np.empty_like(x), c.copy(), c.copy(), x,
                                                      c, c, c.copy(), c.copy(), c64, c64, 1)
    with pytest.raises(ValueError, match="^sums: expected shape"):
        batchnorm.batchnorm2d_gradient_sums(np.zeros((3, 2)), c.copy(), c.copy(), x, x, c, c)
    with pytest.raises(ValueError, match="^dx: .*read-only"):
        dx = np.empty_like(x)
        dx.flags.writeable = False
        batchnorm.batchnorm2d_input_gradient(dx, x, x, c, c, c, np.zeros((2, 3)), 8)
    with pytest.raises(ValueError, match="overlap"):
        sums = np.zeros(3)
        batchnorm.batchnorm2d_shard_sums(sums, sums, x)


class ThreadGroup:
    """Ranks simulated by threads for nn.BatchNorm2d.batch_stats_group: allreduce_sum adds
    every member's array in rank order (as dynar's allreduce leaves the same bytes on each)."""

    def __init__(self, size):
        import threading
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def member(self, rank):
        group = self

        class Member:
            def allreduce_sum(self, array):
                group.slots[rank] = array.copy()
                group.barrier.wait()
                total = np.sum(group.slots, axis=0)
                group.barrier.wait()
                array[:] = total

        return Member()


def test_batchnorm_layers_over_a_group_train_as_one_layer_over_the_whole_batch(rng):
    # Three "ranks" (threads), each a BatchNorm2d over its share: outputs, d(input), running
    # statistics as one layer's over the whole batch; the shares' parameter gradients add up
    # to the whole batch's (the gradient synchronizer averages them).
    import threading

    from dynar import nn
    x = (1 + 2 * rng.standard_normal((6, 4, 3, 3))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    whole = nn.BatchNorm2d(4)
    layers = [nn.BatchNorm2d(4) for _ in range(3)]
    for layer in [whole] + layers:
        layer.weight.data[:] = np.linspace(0.5, 2, 4)
        layer.bias.data[:] = np.linspace(-1, 1, 4)
    group = ThreadGroup(3)
    shares = np.split(np.arange(6), [1, 3])      # uneven shares: 1, 2, 3 images
    out = [None] * 3

    def rank(r):
        layers[r].batch_stats_group = group.member(r)
        for _ in range(2):                       # running statistics move twice
            layers[r].weight.grad.fill(0)
            layers[r].bias.grad.fill(0)
            y = layers[r].forward(x[shares[r]]).copy()
            out[r] = (y, layers[r].backward(dy[shares[r]].copy()).copy())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(2):
        whole.weight.grad.fill(0)
        whole.bias.grad.fill(0)
        y = whole.forward(x)
        dx = whole.backward(dy.copy())
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([o[0] for o in out]), y, **tol)
    np.testing.assert_allclose(np.concatenate([o[1] for o in out]), dx, **tol)
    np.testing.assert_allclose(sum(layer.weight.grad for layer in layers), whole.weight.grad,
                               **tol)
    np.testing.assert_allclose(sum(layer.bias.grad for layer in layers), whole.bias.grad, **tol)
    for layer in layers:
        np.testing.assert_allclose(layer.running_mean, whole.running_mean, **tol)
        np.testing.assert_allclose(layer.running_var, whole.running_var, **tol)
        assert layer.num_batches_tracked == 2
    # Without the group each share is normalized over itself: not the whole batch's outputs.
    alone = nn.BatchNorm2d(4)
    alone.weight.data[:], alone.bias.data[:] = layers[0].weight.data, layers[0].bias.data
    assert not np.allclose(alone.forward(x[shares[0]]), y[shares[0]], atol=1e-2)
