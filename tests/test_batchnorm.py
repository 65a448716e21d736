import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import batchnorm
from gradcheck import assert_gradient
from conftest import at_thread_counts, require_torch

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


@pytest.mark.parametrize("case", _random_parity_cases(20))
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


def test_batchnorm_thread_count_one_vs_two_is_bitwise(rng):
    x = rng.standard_normal((4, 6, 5, 5)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.standard_normal(6).astype(np.float32)
    beta = rng.standard_normal(6).astype(np.float32)

    def run(training):
        stats = _random_stats(np.random.default_rng(3), 6, np.float32)
        y = _forward(x, gamma, beta, stats, training)
        return (y, stats.mean, stats.invstd, stats.running_mean, stats.running_var,
                *_backward(dy, x, gamma, stats, training))

    for training in (True, False):
        one, two = at_thread_counts(lambda: run(training))
        # Every sum belongs to one channel, which one thread computes in a fixed order.
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


vectors = st.one_of(
    st.none(), st.floats(),
    st.tuples(st.integers(0, 4), st.sampled_from([np.float32, np.float64, np.int32])).map(
        lambda t: np.zeros(t[0], t[1])),
    st.integers(2, 8).map(lambda n: np.zeros(n, np.float32)[::2]),
)
images = st.one_of(
    st.none(), st.integers(),
    st.tuples(st.lists(st.integers(0, 3), min_size=3, max_size=5),
              st.sampled_from([np.float32, np.float64])).map(lambda t: np.zeros(t[0], t[1])),
    st.lists(st.integers(1, 3), min_size=4, max_size=4).map(
        lambda s: np.zeros(s, np.float32).transpose(0, 1, 3, 2)),
)
scalars = st.one_of(st.floats(), st.integers(-2, 2), st.none(), st.text(max_size=2),
                    st.just(10 ** 400))


@settings(max_examples=300, deadline=None)
@given(y=images, x=images, dy=images, per_channel=st.lists(vectors, min_size=8, max_size=8),
       training=st.one_of(st.booleans(), st.none(), st.integers(0, 1)), momentum=scalars,
       eps=scalars, backward=st.booleans())
def test_batchnorm_bad_input_always_raises_a_python_exception(y, x, dy, per_channel, training,
                                                              momentum, eps, backward):
    # Anything but TypeError/ValueError (a crash, SystemError, OverflowError) fails the test.
    try:
        if backward:
            batchnorm.batchnorm2d_backward(y, *per_channel[:2], dy, x, *per_channel[2:5],
                                           training)
        else:
            batchnorm.batchnorm2d_forward(y, *per_channel[:2], x, *per_channel[2:6], training,
                                          momentum, eps)
    except (TypeError, ValueError):
        pass
