import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import sgd
from conftest import at_thread_counts, require_torch

CONFIGS = [
    dict(),
    dict(weight_decay=5e-4),
    dict(momentum=0.9),
    dict(momentum=0.9, weight_decay=5e-4),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, nesterov=True, weight_decay=1e-2),
]


def _steps(p, grads, lr, **options):
    """p after one sgd_step per gradient, from a zero momentum buffer; and that buffer."""
    p = p.copy()
    buf = np.zeros_like(p)
    for g in grads:
        sgd.sgd_step(p, g, buf, lr, **options)
    return p, buf


@pytest.mark.parametrize("dtype, tol", [
    # float32: gcc fuses momentum*buf + d into one FMA where torch rounds twice, so results
    # drift by a few ulp over the 5 steps; float64 shows the formulas agree to rounding.
    (np.float32, dict(rtol=1e-6, atol=1e-6)),
    (np.float64, dict(rtol=1e-14, atol=1e-15)),
])
@pytest.mark.parametrize("options", CONFIGS)
def test_sgd_matches_pytorch_over_five_steps(options, dtype, tol, rng):
    torch = require_torch()
    p0 = rng.standard_normal(1000).astype(dtype)
    grads = [rng.standard_normal(1000).astype(dtype) for _ in range(5)]
    ref = torch.tensor(p0.copy(), requires_grad=True)
    opt = torch.optim.SGD([ref], lr=0.1, **options)
    p = p0.copy()
    buf = np.zeros_like(p)
    for g in grads:
        ref.grad = torch.tensor(g)
        opt.step()
        sgd.sgd_step(p, g, buf, 0.1, **options)
        np.testing.assert_allclose(p, ref.detach().numpy(), **tol)
        if options.get("momentum"):
            np.testing.assert_allclose(buf, opt.state[ref]["momentum_buffer"].numpy(), **tol)


def test_zero_buffer_gives_plain_first_step_bit_exactly(rng):
    p0 = rng.standard_normal(5000).astype(np.float32)
    g = rng.standard_normal(5000).astype(np.float32)
    with_momentum, buf = _steps(p0, [g], 0.1, momentum=0.9, weight_decay=1e-3)
    plain, _ = _steps(p0, [g], 0.1, weight_decay=1e-3)
    np.testing.assert_array_equal(with_momentum, plain)
    _, buf = _steps(p0, [g], 0.1, momentum=0.9)
    np.testing.assert_array_equal(buf, g)


def test_sgd_dampening_follows_the_zero_buffer_formula(rng):
    # Against the documented recurrence, from a zero buffer. (PyTorch differs on the first
    # step only: it copies d into the buffer undamped.)
    p0 = rng.standard_normal(100)
    grads = [rng.standard_normal(100) for _ in range(4)]
    p, buf = _steps(p0, grads, 0.05, momentum=0.8, weight_decay=1e-2, dampening=0.3)
    ref_p, ref_buf = p0.copy(), np.zeros(100)
    for g in grads:
        d = g + 1e-2 * ref_p
        ref_buf = 0.8 * ref_buf + 0.7 * d
        ref_p = ref_p - 0.05 * ref_buf
    np.testing.assert_allclose(buf, ref_buf, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(p, ref_p, rtol=1e-13, atol=1e-15)


def test_sgd_dampening_matches_pytorch_when_the_first_step_is_undamped(rng):
    torch = require_torch()
    p = rng.standard_normal(100)
    grads = [rng.standard_normal(100) for _ in range(4)]
    ref = torch.tensor(p.copy(), requires_grad=True)
    opt = torch.optim.SGD([ref], lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-2)
    buf = np.zeros_like(p)
    for step, g in enumerate(grads):
        ref.grad = torch.tensor(g)
        opt.step()
        sgd.sgd_step(p, g, buf, 0.05, 0.8, 1e-2, dampening=0.3 if step else 0.0)
    # float64: the formulas agree up to rounding.
    np.testing.assert_allclose(p, ref.detach().numpy(), rtol=1e-14, atol=1e-15)


def test_sgd_without_momentum_leaves_the_buffer_alone(rng):
    p = rng.standard_normal(10)
    g = rng.standard_normal(10)
    buf = rng.standard_normal(10)
    saved = buf.copy()
    sgd.sgd_step(p, g, buf, 0.1, weight_decay=0.1)
    np.testing.assert_array_equal(buf, saved)
    sgd.sgd_step(p, g, None, 0.1)


@pytest.mark.parametrize("options", [CONFIGS[1], CONFIGS[3], CONFIGS[5]])
def test_sgd_thread_count_one_vs_two_is_bitwise(options, rng):
    # 100003 elements: four chunks of 32768 to share, the last one partial.
    p0 = rng.standard_normal(100003).astype(np.float32)
    grads = [rng.standard_normal(100003).astype(np.float32) for _ in range(3)]
    one, two = at_thread_counts(lambda: _steps(p0, grads, 0.1, **options))
    # Element-wise update: the partition can never change a result.
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(lr=-0.1), ValueError, "lr"),
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(lr=True), TypeError, "lr"),
    (dict(lr=10 ** 400), ValueError, "lr"),
    (dict(momentum=-0.9), ValueError, "momentum"),
    (dict(weight_decay=-1e-4), ValueError, "weight_decay"),
    (dict(dampening=float("inf")), ValueError, "dampening"),
    (dict(nesterov=True), ValueError, "nesterov"),                 # no momentum
    (dict(momentum=0.9, nesterov=True, dampening=0.1), ValueError, "nesterov"),
    (dict(momentum=0.9, nesterov=1), TypeError, "nesterov"),
    (dict(momentum=0.9, momentum_buf=None), ValueError, "momentum_buf"),
    (dict(momentum_buf=np.zeros(4, np.float32)), ValueError, "momentum_buf"),
    (dict(momentum_buf=np.zeros(5, np.float64)), TypeError, "momentum_buf"),
    (dict(grads=np.zeros(5, np.float64)), TypeError, "grads"),
    (dict(grads=np.zeros((5, 1), np.float32)), ValueError, "grads"),
    (dict(params=np.zeros(0, np.float32), grads=np.zeros(0, np.float32)), ValueError, "params"),
    (dict(params=np.zeros(10, np.float32)[::2]), ValueError, "params"),
    (dict(params=[0.0] * 5), TypeError, "params"),
])
def test_sgd_errors_name_the_argument(kwargs, error, name):
    args = dict(params=np.zeros(5, np.float32), grads=np.zeros(5, np.float32),
                momentum_buf=np.zeros(5, np.float32), lr=0.1)
    args.update(kwargs)
    with pytest.raises(error, match=f"^{name}"):
        sgd.sgd_step(**args)


def test_sgd_rejects_overlapping_buffers():
    flat = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        sgd.sgd_step(flat[:6], flat[4:], None, 0.1)
    with pytest.raises(ValueError, match="overlap"):
        sgd.sgd_step(flat[:5], flat[5:], flat[2:7], 0.1, momentum=0.9)


vectors = st.one_of(
    st.none(), st.floats(), st.integers(),
    st.tuples(st.integers(0, 5), st.sampled_from([np.float32, np.float64, np.int32])).map(
        lambda t: np.zeros(t[0], t[1])),
    st.integers(2, 10).map(lambda n: np.zeros(n, np.float32)[::2]),
    st.integers(1, 3).map(lambda n: np.zeros((n, 2), np.float32)),
)
hyper = st.one_of(st.floats(), st.integers(), st.none(), st.booleans(), st.text(max_size=2))


@settings(max_examples=300, deadline=None)
@given(params=vectors, grads=vectors, buf=vectors, lr=hyper, momentum=hyper, wd=hyper,
       nesterov=st.one_of(st.booleans(), st.none(), st.integers(0, 1)), dampening=hyper)
def test_sgd_bad_input_always_raises_a_python_exception(params, grads, buf, lr, momentum, wd,
                                                        nesterov, dampening):
    # Anything but TypeError/ValueError (a crash, SystemError, OverflowError) fails the test.
    try:
        sgd.sgd_step(params, grads, buf, lr, momentum, wd, nesterov, dampening)
    except (TypeError, ValueError):
        pass
