import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import activation as act
from gradcheck import assert_gradient
from conftest import assert_zero_sizes_rejected, at_thread_counts, require_torch

# Shapes of every rank; the last two exceed the 32768-element serial cut-off (with a partial
# last chunk), so the chunked prange path is checked too.
SHAPES = [(7,), (2, 3, 5, 5), (1, 1, 1, 1), (3, 4), (5, 3, 4, 5, 2)]
BIG = [(100_003,), (3, 7, 41, 53)]


def _away_from_zero(rng, shape):
    # ReLU has a kink at 0: keep |x| >= 0.01, far beyond the checker's 1e-6 perturbations.
    x = rng.standard_normal(shape)
    return np.where(x < 0, x - 0.01, x + 0.01)


def _relu(x, dy=None):
    y = np.empty_like(x)
    act.relu_forward(y, x)
    dx = None
    if dy is not None:
        dx = np.empty_like(x)
        act.relu_backward(dx, dy, y)
    return y, dx


def _dropout(x, p, seed, dy=None):
    y, mask = np.empty_like(x), np.empty(x.shape, np.uint8)
    act.dropout_forward(y, mask, x, p, seed)
    dx = None
    if dy is not None:
        dx = np.empty_like(x)
        act.dropout_backward(dx, dy, mask, p)
    return y, mask, dx


def _add(a, b, dy=None):
    y = np.empty_like(a)
    act.add_forward(y, a, b)
    da = db = None
    if dy is not None:
        da, db = np.empty_like(a), np.empty_like(b)
        act.add_backward(da, db, dy)
    return y, da, db


@pytest.mark.parametrize("shape", SHAPES)
def test_relu_gradient_matches_central_differences(shape, rng):
    x = _away_from_zero(rng, shape)
    proj = rng.standard_normal(shape)
    dx = _relu(x, proj)[1]
    assert_gradient("x", dx, lambda: float(np.sum(_relu(x)[0] * proj)), x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.3, 0.75])
def test_dropout_gradient_matches_central_differences(shape, p, rng):
    # For a fixed seed the mask is fixed, so dropout is a linear function of x.
    x = rng.standard_normal(shape)
    proj = rng.standard_normal(shape)
    dx = _dropout(x, p, 99, proj)[2]
    assert_gradient("x", dx, lambda: float(np.sum(_dropout(x, p, 99)[0] * proj)), x)


@pytest.mark.parametrize("shape", SHAPES)
def test_add_gradient_matches_central_differences(shape, rng):
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    proj = rng.standard_normal(shape)
    _, da, db = _add(a, b, proj)

    def loss():
        return float(np.sum(_add(a, b)[0] * proj))

    assert_gradient("a", da, loss, a)
    assert_gradient("b", db, loss, b)


@pytest.mark.parametrize("shape", SHAPES + BIG)
def test_relu_float32_matches_pytorch(shape, rng):
    torch = require_torch()
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:3] = [np.nan, -0.0, 0.0][:x.size]
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.relu(xt)
    dy = rng.standard_normal(shape).astype(np.float32)
    yt.backward(torch.tensor(dy))
    y, dx = _relu(x, dy)
    # A select, no arithmetic: exact, including NaN passing through. relu(-0.0) keeps the
    # sign (x is selected, as by torch on x86); torch's aarch64 vector path returns +0.0,
    # so zeros are checked against the rule rather than against torch.
    yref = yt.detach().numpy()
    np.testing.assert_array_equal(y, yref)
    nonzero = x != 0
    np.testing.assert_array_equal(np.signbit(y[nonzero]), np.signbit(yref[nonzero]))
    np.testing.assert_array_equal(np.signbit(y[~nonzero]), np.signbit(x[~nonzero]))
    np.testing.assert_array_equal(dx, xt.grad.numpy())


@pytest.mark.parametrize("shape", SHAPES + BIG)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_dropout_float32_follows_the_formula(shape, p, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    y, mask, dx = _dropout(x, p, 1234, dy)
    assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}
    # x * (mask * scale) against x * mask / (1 - p): one rounding apart, rtol 2 ulps.
    np.testing.assert_allclose(y, x * mask / np.float32(1 - p), rtol=2.4e-7, atol=0)
    np.testing.assert_allclose(dx, dy * mask / np.float32(1 - p), rtol=2.4e-7, atol=0)
    if p == 0:
        assert mask.all()
        np.testing.assert_array_equal(y, x)


def test_dropout_mask_depends_on_seed_and_index_only():
    x = np.ones(100_003, np.float32)
    _, mask, _ = _dropout(x, 0.5, 42)
    np.testing.assert_array_equal(_dropout(x, 0.5, 42)[1], mask)
    # The first n elements of a longer array (serial vs chunked path) and a reshaped array
    # get the same mask: element i's fate is a function of (seed, i).
    np.testing.assert_array_equal(_dropout(x[:1000].copy(), 0.5, 42)[1], mask[:1000])
    np.testing.assert_array_equal(_dropout(np.ones((7, 14285), np.float32), 0.5, 42)[1].ravel(),
                                  mask[:7 * 14285])
    # float64 and float32 share it too.
    np.testing.assert_array_equal(_dropout(x.astype(np.float64), 0.5, 42)[1], mask)
    # Neighbouring seeds give unrelated masks, not one shifted by a few elements: two
    # independent fair coins agree half the time (6 sigma = 0.0095 at this size).
    for other in (43, 0, 2 ** 64 - 1):
        other_mask = _dropout(x, 0.5, other)[1]
        assert abs(np.mean(other_mask == mask) - 0.5) < 0.0095
        assert abs(np.mean(other_mask[1:] == mask[:-1]) - 0.5) < 0.0095


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_about_one_minus_p(p):
    n = 400_000
    mask = _dropout(np.ones(n, np.float32), p, 7)[1]
    # Binomial(n, 1-p) mean: within 6 standard deviations (sqrt(p(1-p)/n) <= 0.0008).
    assert abs(mask.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / n)


def test_add_backward_skips_none_and_allows_in_place(rng):
    dy = rng.standard_normal((3, 4))
    da = np.full_like(dy, 9.0)
    act.add_backward(da, None, dy)
    np.testing.assert_array_equal(da, dy)
    db = np.full_like(dy, 9.0)
    act.add_backward(None, db, dy)
    np.testing.assert_array_equal(db, dy)
    act.add_backward(None, None, dy)
    before = dy.copy()
    act.add_backward(dy, db, dy)
    np.testing.assert_array_equal(dy, before)


@pytest.mark.parametrize("shape", [(5, 6), (100_003,)])
def test_outputs_may_be_their_inputs(shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    y, dx = _relu(x, dy)
    inplace = x.copy()
    act.relu_forward(inplace, inplace)
    np.testing.assert_array_equal(inplace, y)
    inplace = dy.copy()
    act.relu_backward(inplace, inplace, y)
    np.testing.assert_array_equal(inplace, dx)

    yd, mask, dxd = _dropout(x, 0.4, 5, dy)
    inplace = x.copy()
    act.dropout_forward(inplace, np.empty(shape, np.uint8), inplace, 0.4, 5)
    np.testing.assert_array_equal(inplace, yd)
    inplace = dy.copy()
    act.dropout_backward(inplace, inplace, mask, 0.4)
    np.testing.assert_array_equal(inplace, dxd)

    a, b = x.copy(), dy.copy()
    act.add_forward(a, a, b)
    act.add_forward(b, x, b)
    np.testing.assert_array_equal(a, x + dy)
    np.testing.assert_array_equal(b, x + dy)


def test_partial_overlap_is_refused():
    flat = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="^y must not overlap x"):
        act.relu_forward(flat[1:11], flat[:10])
    with pytest.raises(ValueError, match="^dx must not overlap dy"):
        act.dropout_backward(flat[:10], flat[2:12], np.ones(10, np.uint8), 0.5)
    with pytest.raises(ValueError, match="^db must not overlap da"):
        act.add_backward(flat[:10], flat[5:15], np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="^mask must not overlap x"):
        x = np.zeros(16, np.float32)
        act.dropout_forward(np.zeros(16, np.float32), x.view(np.uint8)[:16], x, 0.5, 1)


def test_elementwise_thread_count_one_vs_two_is_bitwise(rng):
    x = rng.standard_normal(BIG[1]).astype(np.float32)
    dy = rng.standard_normal(BIG[1]).astype(np.float32)

    def run():
        return (*_relu(x, dy), *_dropout(x, 0.3, 11, dy), *_add(x, dy, dy))

    one, two = at_thread_counts(lambda: run())
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_activation_errors_name_the_argument():
    x = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), np.uint8)
    with pytest.raises(TypeError, match="^x: "):
        act.relu_forward(x, x.astype(np.int32))
    with pytest.raises(TypeError, match="^y: "):
        act.relu_forward(x.astype(np.float64), x)
    with pytest.raises(ValueError, match="^y: expected 2 dimensions"):
        act.relu_forward(x.reshape(-1), x)
    with pytest.raises(ValueError, match="^b: expected shape"):
        act.add_forward(x, x, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="^a: must be C-contiguous"):
        act.add_forward(x.T.copy(), x.T, x.T.copy())
    with pytest.raises(TypeError, match="^mask: "):
        act.dropout_backward(x, x, mask.astype(bool), 0.5)
    for p in (1.0, -0.1, float("nan"), 2):
        with pytest.raises(ValueError, match="^p: must be in \\[0, 1\\)"):
            act.dropout_forward(x, mask, x, p, 0)
    for p in (True, "0.5", None):
        with pytest.raises(TypeError, match="^p: "):
            act.dropout_backward(x, x, mask, p)
    for seed in (-1, 2 ** 64):
        with pytest.raises(ValueError, match="^seed: must be in"):
            act.dropout_forward(x, mask, x, 0.5, seed)
    with pytest.raises(TypeError, match="^seed: expected an int"):
        act.dropout_forward(x, mask, x, 0.5, 1.5)


def _valid_args(op):
    x = np.zeros((2, 3, 4), np.float32)
    mask = np.ones(x.shape, np.uint8)
    return {
        "relu_forward": dict(y=x.copy(), x=x),
        "relu_backward": dict(dx=x.copy(), dy=x, y=x.copy()),
        "dropout_forward": dict(y=x.copy(), mask=mask, x=x),
        "dropout_backward": dict(dx=x.copy(), dy=x, mask=mask),
        "add_forward": dict(y=x.copy(), a=x, b=x.copy()),
        "add_backward": dict(da=x.copy(), db=x.copy(), dy=x),
    }[op]


SCALARS = {"dropout_forward": (0.5, 3), "dropout_backward": (0.5,)}
ENTRY_POINTS = ["relu_forward", "relu_backward", "dropout_forward", "dropout_backward",
                "add_forward", "add_backward"]


@pytest.mark.parametrize("op", ENTRY_POINTS)
def test_activation_zero_size_dimensions_are_value_errors_naming_the_argument(op):
    assert_zero_sizes_rejected(getattr(act, op), _valid_args(op), SCALARS.get(op, ()))


bad_values = st.one_of(
    st.none(), st.integers(-3, 3), st.integers(2 ** 63, 2 ** 70), st.floats(allow_nan=True),
    st.text(max_size=2), st.booleans(),
    st.tuples(st.lists(st.integers(0, 4), max_size=4),
              st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]),
              st.booleans()).map(
        lambda t: np.zeros(t[0], t[1]) if t[2] or len(t[0]) == 0 else np.zeros(t[0], t[1])[..., ::-1]),
)


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from(ENTRY_POINTS), data=st.data())
def test_activation_bad_input_always_raises_a_python_exception(op, data):
    args = list(_valid_args(op).values()) + list(SCALARS.get(op, ()))
    # Start from a valid call so that each check is reached, then spoil 1 to 3 arguments.
    for i in data.draw(st.lists(st.integers(0, len(args) - 1), min_size=1, max_size=3)):
        args[i] = data.draw(bad_values)
    try:
        getattr(act, op)(*args)
    except (TypeError, ValueError):
        pass
