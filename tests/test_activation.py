import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import activation as act, bf16
from gradcheck import assert_gradient
from support import assert_zero_sizes_rejected, at_thread_counts, require_torch
from support.bad_inputs import as_int, as_real, float_dtype, is_array, run_spoiled, spoiled_calls

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


def _add(a, b):
    y = np.empty_like(a)
    act.add(y, a, b)
    return y


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


@pytest.mark.parametrize("shape", [(7,), (3, 7, 41, 53)])
def test_relu_keeps_a_bf16_copy_of_its_output_and_masks_by_it(shape, rng):
    # bf16 training keeps this copy instead of the output (nn/activation.py).
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[:5] = [np.nan, -0.0, 1e-40, -np.inf, np.inf]    # 1e-40: subnormal, 0 in bf16
    dy = rng.standard_normal(shape).astype(np.float32)
    y, _ = _relu(x)
    got, bits = np.empty_like(x), np.empty(shape, np.uint16)
    act.relu_forward(got, x, bits)
    np.testing.assert_array_equal(got.view(np.uint32), y.view(np.uint32))
    want = np.empty_like(bits)
    bf16.to_bf16(want, y)
    np.testing.assert_array_equal(bits, want)
    widened = np.empty_like(y)
    bf16.to_float32(widened, bits)
    dx, want_dx = np.empty_like(dy), np.empty_like(dy)
    act.relu_backward(dx, dy, bits)
    act.relu_backward(want_dx, dy, widened)
    np.testing.assert_array_equal(dx, want_dx)
    assert dx.flat[0] == dy.flat[0] and dx.flat[2] == 0 and dx.flat[4] == dy.flat[4]
    inplace = dy.copy()
    act.relu_backward(inplace, inplace, bits)
    np.testing.assert_array_equal(inplace, dx)


def test_relu_bf16_copy_is_refused_where_it_does_not_fit(rng):
    x = rng.standard_normal((4, 5)).astype(np.float32)
    y, bits = np.empty_like(x), np.empty((4, 5), np.uint16)
    with pytest.raises(TypeError, match="y_bf16: bf16 goes with float32 data"):
        act.relu_forward(y.astype(np.float64), x.astype(np.float64), bits)
    with pytest.raises(ValueError, match="y_bf16"):
        act.relu_forward(y, x, np.empty((4, 6), np.uint16))
    with pytest.raises(TypeError, match="y_bf16"):
        act.relu_forward(y, x, np.empty((4, 5), np.int16))
    with pytest.raises(ValueError, match="y_bf16"):
        act.relu_forward(y, x, y.view(np.uint16)[:, :5])     # inside y
    with pytest.raises(TypeError, match="y: bf16 goes with float32 data"):
        act.relu_backward(np.empty((4, 5)), np.zeros((4, 5)), bits)


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
    act.add(a, a, b)
    act.add(b, x, b)
    np.testing.assert_array_equal(a, x + dy)
    np.testing.assert_array_equal(b, x + dy)


def test_partial_overlap_is_refused():
    flat = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="^y must not overlap x"):
        act.relu_forward(flat[1:11], flat[:10])
    with pytest.raises(ValueError, match="^dx must not overlap dy"):
        act.dropout_backward(flat[:10], flat[2:12], np.ones(10, np.uint8), 0.5)
    with pytest.raises(ValueError, match="^y must not overlap a"):
        act.add(flat[:10], flat[5:15], np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="^mask must not overlap x"):
        x = np.zeros(16, np.float32)
        act.dropout_forward(np.zeros(16, np.float32), x.view(np.uint8)[:16], x, 0.5, 1)


def test_elementwise_thread_count_one_vs_two_is_bitwise(rng):
    x = rng.standard_normal(BIG[1]).astype(np.float32)
    dy = rng.standard_normal(BIG[1]).astype(np.float32)

    def run():
        return (*_relu(x, dy), *_dropout(x, 0.3, 11, dy), _add(x, dy))

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
        act.add(x, x, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="^a: must be C-contiguous"):
        act.add(x.T.copy(), x.T, x.T.copy())
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


def _valid_args(op, rng=None):
    """A valid float32 call of entry point `op`, every argument by name (random values if a
    generator is given, else zeros)."""
    x = np.zeros((2, 3, 4), np.float32) if rng is None else \
        rng.standard_normal((2, 3, 4)).astype(np.float32)
    mask = np.ones(x.shape, np.uint8) if rng is None else \
        rng.integers(0, 2, x.shape).astype(np.uint8)
    return {
        "relu_forward": dict(y=x.copy(), x=x),
        "relu_backward": dict(dx=x.copy(), dy=-x, y=x.copy()),
        "dropout_forward": dict(y=x.copy(), mask=mask, x=x, p=0.5, seed=3),
        "dropout_backward": dict(dx=x.copy(), dy=-x, mask=mask, p=0.5),
        "add": dict(y=x.copy(), a=x, b=-2 * x),
    }[op]


ENTRY_POINTS = ["relu_forward", "relu_backward", "dropout_forward", "dropout_backward", "add"]


@pytest.mark.parametrize("op", ENTRY_POINTS)
def test_activation_zero_size_dimensions_are_value_errors_naming_the_argument(op):
    args = _valid_args(op)
    arrays = {name: value for name, value in args.items() if isinstance(value, np.ndarray)}
    scalars = [value for value in args.values() if not isinstance(value, np.ndarray)]
    assert_zero_sizes_rejected(getattr(act, op), arrays, scalars)


OUTPUTS = {"relu_forward": {"y"}, "relu_backward": {"dx"}, "dropout_forward": {"y", "mask"},
           "dropout_backward": {"dx"}, "add": {"y"}}


def _accepts(op, args):
    """Whether `op` must compute `args` (else refuse them), decided from the arguments: its
    float arrays non-empty, of one float dtype and one shape, C-contiguous, aligned, outputs
    writeable; the uint8 mask of that shape; p a real in
    [0, 1); seed an int in [0, 2^64). Exact aliasing is allowed, as every element is read
    before it is written; no other overlap can arise from whole arguments."""
    names = [n for n in args if n not in ("mask", "p", "seed")]
    # Every float array must have the dtype and shape of any one of them: take the last.
    dtype = float_dtype(args[names[-1]])
    shape = getattr(args[names[-1]], "shape", ())
    if dtype is None or np.prod(shape) == 0:
        return False
    outputs = OUTPUTS[op]
    if not all(is_array(args[n], dtype, shape, output=n in outputs) for n in names):
        return False
    if "mask" in args and not is_array(args["mask"], np.uint8, shape, output="mask" in outputs):
        return False
    if "p" in args and not (as_real(args["p"]) is not None and 0 <= as_real(args["p"]) < 1):
        return False
    seed = as_int(args.get("seed", 0))
    return seed is not None and 0 <= seed < 2 ** 64


def _assert_computed(op, before, args):
    """The outputs in `args` after the call are op applied to the inputs in `before`."""
    if op == "relu_forward":
        np.testing.assert_array_equal(args["y"], np.where(before["x"] < 0, 0, before["x"]))
    elif op == "relu_backward":
        np.testing.assert_array_equal(args["dx"], np.where(before["y"] <= 0, 0, before["dy"]))
    elif op in ("dropout_forward", "dropout_backward"):
        mask = args["mask"]
        if op == "dropout_forward":
            assert set(np.unique(mask)) <= {0, 1}
        source, out = ("x", "y") if op == "dropout_forward" else ("dy", "dx")
        scale = 1 / (1 - as_real(args["p"]))
        np.testing.assert_allclose(args[out], before[source] * mask * scale, rtol=1e-6)
    else:
        np.testing.assert_array_equal(args["y"], before["a"] + before["b"])


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from(ENTRY_POINTS), data=st.data())
def test_activation_bad_input_always_raises_a_python_exception(op, data):
    # A valid call with 1 to 3 arguments replaced: many replacements keep it valid (a copy,
    # p = 0, an in-place alias), the others must be refused.
    args = data.draw(spoiled_calls(_valid_args(op, np.random.default_rng(0)),
                                   values={"p": st.floats(0, 1), "seed": st.integers(0, 2 ** 64)}))
    ran = run_spoiled(getattr(act, op), args, _accepts(op, args))
    if ran:
        _assert_computed(op, ran[0], args)
