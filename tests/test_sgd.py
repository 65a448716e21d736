import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import sgd
from support import at_thread_counts, require_torch
from support.bad_inputs import as_real, float_dtype, is_array, overlap, run_spoiled, spoiled_calls

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


HYPER = ("lr", "momentum", "weight_decay", "dampening")


def _valid_args(nesterov):
    """A valid float32 sgd_step call, every argument by name: 5 parameters, random values,
    momentum (Nesterov's if asked) and weight decay."""
    rng = np.random.default_rng(0)
    params, grads, buf = (rng.standard_normal(5).astype(np.float32) for _ in range(3))
    return dict(params=params, grads=grads, momentum_buf=buf, lr=0.1, momentum=0.9,
                weight_decay=1e-3, nesterov=nesterov, dampening=0.0)


def _accepts(args):
    """Whether sgd_step must compute `args` (else refuse them), decided from the arguments:
    params a non-empty 1-D float array, grads and momentum_buf of its dtype and shape, all
    C-contiguous and aligned, params and momentum_buf writeable and sharing no memory with
    another argument; momentum_buf None only without momentum; the hyper-parameters finite
    reals, lr, momentum and weight_decay >= 0; nesterov a bool, and True only with momentum > 0
    and no dampening."""
    params = args["params"]
    dtype = float_dtype(params)
    if not is_array(params, dtype, ndim=1, output=True) or params.size == 0 \
            or not is_array(args["grads"], dtype, params.shape):
        return False
    hyper = {name: as_real(args[name]) for name in HYPER}
    if any(value is None or not math.isfinite(value) for value in hyper.values()) \
            or min(hyper["lr"], hyper["momentum"], hyper["weight_decay"]) < 0:
        return False
    nesterov = args["nesterov"]
    if not isinstance(nesterov, bool) \
            or nesterov and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
        return False
    buf = args["momentum_buf"]
    if buf is None:
        return hyper["momentum"] == 0
    return is_array(buf, dtype, params.shape, output=True) \
        and not overlap(args, ["params", "momentum_buf"])


def _assert_computed(before, args):
    """params and momentum_buf after the call follow pyx/sgd.pyx's formulas from `before`,
    in the parameters' precision (FMA contraction allowed for)."""
    t = before["params"].dtype.type
    lr, momentum, weight_decay, dampening = (t(as_real(args[name])) for name in HYPER)
    p, d = before["params"], before["grads"]
    if weight_decay != 0:
        d = d + weight_decay * p
    if as_real(args["momentum"]) != 0:   # decided in double: momentum 1e-300 keeps a buffer
        old, new = momentum * before["momentum_buf"], (1 - dampening) * d
        buf = old + new
        # Relative to the terms, not the sum: where they nearly cancel, FMA contraction
        # moves the small result by more than 1e-5 of itself.
        got = args["momentum_buf"]
        err = np.where(got == buf, 0, np.abs(got - buf))   # the same infinity: no error
        assert (err <= 1e-5 * (np.abs(old) + np.abs(new)) + 1e-30).all(), (
            args["momentum_buf"], buf)
        d = d + momentum * buf if args["nesterov"] else buf
    elif args["momentum_buf"] is not None:
        np.testing.assert_array_equal(args["momentum_buf"], before["momentum_buf"])
    np.testing.assert_allclose(args["params"], p - lr * d, rtol=1e-5, atol=1e-6)


@settings(max_examples=300, deadline=None)
@given(nesterov=st.booleans(), data=st.data())
def test_sgd_bad_input_always_raises_a_python_exception(nesterov, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # no buffer at momentum 0, other hyper-parameters), the others must be refused.
    hyper = st.one_of(st.floats(0, 2), st.just(0.0))
    args = data.draw(spoiled_calls(_valid_args(nesterov),
                                   values=dict.fromkeys(HYPER, hyper)))
    with np.errstate(over="ignore", invalid="ignore"):   # huge hyper-parameters are valid
        ran = run_spoiled(sgd.sgd_step, args, _accepts(args))
        if ran:
            _assert_computed(ran[0], args)
