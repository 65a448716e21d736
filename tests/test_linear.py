import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import linear
from gradcheck import assert_gradient
from conftest import at_thread_counts, require_torch

# (N, in, out, bias): single elements, no bias, and dimensions past the 64-wide GEMM blocks
# (out = 70 cuts forward and dw into two blocks, in = 66 cuts dx into two).
GRAD_CASES = [
    (1, 1, 1, True),
    (3, 5, 4, True),
    (2, 7, 3, False),
    (4, 3, 70, True),
    (2, 66, 5, True),
]


def _run(x, w, b, dy):
    y = np.empty((x.shape[0], w.shape[0]), x.dtype)
    linear.linear_forward(y, x, w, b)
    dx = np.empty_like(x)
    dw = np.zeros_like(w)
    db = None if b is None else np.zeros_like(b)
    if dy is not None:
        linear.linear_backward(dx, dw, db, dy, x, w)
    return y, dx, dw, db


@pytest.mark.parametrize("case", GRAD_CASES)
def test_linear_gradients_match_central_differences(case, rng):
    N, In, Out, bias = case
    x = rng.standard_normal((N, In))
    w = rng.standard_normal((Out, In))
    b = rng.standard_normal(Out) if bias else None
    proj = rng.standard_normal((N, Out))
    _, dx, dw, db = _run(x, w, b, proj)

    def loss():
        return float(np.sum(_run(x, w, b, None)[0] * proj))

    assert_gradient("x", dx, loss, x)
    assert_gradient("w", dw, loss, w)
    if bias:
        assert_gradient("b", db, loss, b)


def test_linear_backward_accumulates_and_skips_dx(rng):
    x = rng.standard_normal((5, 70))
    w = rng.standard_normal((80, 70))
    dy = rng.standard_normal((5, 80))
    dw, db = np.ones_like(w), np.ones(80)
    linear.linear_backward(None, dw, db, dy, x, w)
    np.testing.assert_allclose(dw, dy.T @ x + 1, rtol=1e-12)
    np.testing.assert_allclose(db, dy.sum(0) + 1, rtol=1e-12)
    linear.linear_backward(None, dw, None, dy, x, w)   # no bias: db left alone
    np.testing.assert_allclose(dw, 2 * dy.T @ x + 1, rtol=1e-12)


def _random_parity_cases(count, seed=7):
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 17)), int(rng.integers(1, 150)), int(rng.integers(1, 150)),
             bool(rng.integers(2))) for _ in range(count)]


@pytest.mark.parametrize("case", _random_parity_cases(20))
def test_linear_float32_matches_pytorch(case, rng):
    torch = require_torch()
    N, In, Out, bias = case
    x = rng.standard_normal((N, In)).astype(np.float32)
    w = (rng.standard_normal((Out, In)) / np.sqrt(In)).astype(np.float32)
    b = rng.standard_normal(Out).astype(np.float32) if bias else None
    dy = rng.standard_normal((N, Out)).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    yt = torch.nn.functional.linear(xt, wt, bt)
    yt.backward(torch.tensor(dy))
    y, dx, dw, db = _run(x, w, b, dy)
    # float32, different summation orders over at most 150 O(1) terms.
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-4, atol=1e-4)
    if bias:
        np.testing.assert_allclose(db, bt.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_linear_thread_count_one_vs_two_is_bitwise(rng):
    # 300 outputs and 200 inputs give 5 and 4 GEMM blocks to share between threads.
    x = rng.standard_normal((16, 200)).astype(np.float32)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    dy = rng.standard_normal((16, 300)).astype(np.float32)
    one, two = at_thread_counts(lambda: _run(x, w, b, dy))
    # Blocks depend on the shapes only and never cut a summation: bitwise for every output.
    for a, c in zip(one, two):
        np.testing.assert_array_equal(a, c)


def test_linear_errors_name_the_argument():
    x = np.zeros((2, 3), np.float32)
    w = np.zeros((4, 3), np.float32)
    y = np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match="x"):
        linear.linear_forward(y, x.astype(np.int32), w)
    with pytest.raises(TypeError, match="w"):
        linear.linear_forward(y, x, w.astype(np.float64))
    with pytest.raises(TypeError, match="y"):
        linear.linear_forward(y.astype(np.float64), x, w)
    with pytest.raises(ValueError, match="input features"):
        linear.linear_forward(y, x, np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="^y"):
        linear.linear_forward(np.zeros((2, 5), np.float32), x, w)
    with pytest.raises(ValueError, match="^b"):
        linear.linear_forward(y, x, w, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        linear.linear_forward(y, np.asfortranarray(np.zeros((2, 3), np.float32)), w)
    with pytest.raises(ValueError, match="^x: every dimension"):
        linear.linear_forward(np.zeros((0, 4), np.float32), np.zeros((0, 3), np.float32), w)
    with pytest.raises(ValueError, match="^w: every dimension"):
        linear.linear_forward(np.zeros((2, 0), np.float32), x, np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        linear.linear_forward(w.reshape(-1)[:8].reshape(2, 4), x, w)
    dy = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="^dw"):
        linear.linear_backward(None, np.zeros((3, 4), np.float32), None, dy, x, w)
    with pytest.raises(ValueError, match="^db"):
        linear.linear_backward(None, np.zeros_like(w), np.zeros(3, np.float32), dy, x, w)
    with pytest.raises(ValueError, match="^dx"):
        linear.linear_backward(np.zeros((3, 3), np.float32), np.zeros_like(w), None, dy, x, w)
    with pytest.raises(ValueError, match="^dy"):
        linear.linear_backward(None, np.zeros_like(w), None, dy.T.copy(), x, w)
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.zeros_like(w)
        frozen.flags.writeable = False
        linear.linear_backward(None, frozen, None, dy, x, w)


arrays = st.one_of(
    st.none(), st.integers(-3, 3), st.floats(allow_nan=True),
    st.tuples(st.integers(0, 4), st.integers(0, 4),
              st.sampled_from([np.float32, np.float64, np.int64]), st.booleans()).map(
        lambda t: np.zeros(t[:2], t[2]) if t[3] else np.zeros(t[:2], t[2])[:, ::-1]),
    st.lists(st.integers(0, 4), min_size=1, max_size=3).map(lambda s: np.zeros(s, np.float32)),
)


@settings(max_examples=300, deadline=None)
@given(out=arrays, dw=arrays, db=arrays, dy=arrays, x=arrays, w=arrays, backward=st.booleans())
def test_linear_bad_input_always_raises_a_python_exception(out, dw, db, dy, x, w, backward):
    # Anything but TypeError/ValueError (a crash, SystemError, IndexError) fails the test.
    try:
        if backward:
            linear.linear_backward(out, dw, db, dy, x, w)
        else:
            linear.linear_forward(out, x, w, db)
    except (TypeError, ValueError):
        pass
