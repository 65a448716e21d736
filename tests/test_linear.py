import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conv_checks import SHORT_PASSES
from dynar.kernels import conv, linear
from gradcheck import assert_gradient
from support import assert_zero_sizes_rejected, at_thread_counts, require_torch
from support.bad_inputs import float_dtype, is_array, overlap, run_spoiled, spoiled_calls

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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_backward_without_accumulate_overwrites_and_never_reads(dtype, rng):
    # dw wide and deep enough for several GEMM blocks; NaN where the old values were.
    x = rng.standard_normal((6, 70)).astype(dtype)
    w = rng.standard_normal((130, 70)).astype(dtype)
    dy = rng.standard_normal((6, 130)).astype(dtype)
    dw, db = np.full_like(w, np.nan), np.full(130, np.nan, dtype)
    linear.linear_backward(None, dw, db, dy, x, w, accumulate=False)
    added_w, added_b = np.zeros_like(w), np.zeros(130, dtype)
    linear.linear_backward(None, added_w, added_b, dy, x, w)
    np.testing.assert_array_equal(dw, added_w)
    np.testing.assert_array_equal(db, added_b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_gradient_alone_is_linear_backward_s(dtype, rng):
    # The bias gradient of bf16 layers, whose products run elsewhere: linear_backward's sums
    # bit for bit, overwriting (never reading a stale NaN) or adding.
    x = rng.standard_normal((37, 9)).astype(dtype)
    w = rng.standard_normal((130, 9)).astype(dtype)
    dy = rng.standard_normal((37, 130)).astype(dtype)
    expected = np.empty(130, dtype)
    linear.linear_backward(None, np.zeros_like(w), expected, dy, x, w, accumulate=False)
    db = np.full(130, np.nan, dtype)
    linear.bias_gradient(db, dy, accumulate=False)
    np.testing.assert_array_equal(db, expected)
    linear.bias_gradient(db, dy)
    np.testing.assert_array_equal(db, expected + expected)
    assert_zero_sizes_rejected(linear.bias_gradient, {"db": db, "dy": dy})
    with pytest.raises(TypeError, match="db"):
        linear.bias_gradient(np.zeros(130, np.float64 if dtype == np.float32 else np.float32),
                             dy)


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


CUTS = [(linear.ROWS, 1), (linear.ROWS, 5), (linear.COLS, 7), (linear.COLS, 1024)]


@pytest.mark.parametrize("cut", CUTS)
def test_every_cut_computes_the_products_and_thread_counts_agree_bitwise(cut, rng):
    # Each product cut along each of its axes, in blocks narrower than, not dividing, and
    # wider than the dimension cut (N = 11, in = 23, out = 30): the same sums as float64.
    x = rng.standard_normal((11, 23)).astype(np.float32)
    w = rng.standard_normal((30, 23)).astype(np.float32)
    b = rng.standard_normal(30).astype(np.float32)
    dy = rng.standard_normal((11, 30)).astype(np.float32)

    def run():
        y, dx, dw, db = np.empty((11, 30), np.float32), np.empty_like(x), \
            np.zeros_like(w), np.zeros_like(b)
        linear.linear_forward(y, x, w, b, cut)
        linear.linear_backward(dx, dw, db, dy, x, w, dx_cut=cut, dw_cut=cut)
        return y, dx, dw, db

    one, two = at_thread_counts(run)
    for a, c in zip(one, two):
        np.testing.assert_array_equal(a, c)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    for got, want in zip(one, (x64 @ w64.T + b, dy64 @ w64, dy64.T @ x64, dy64.sum(0))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("passes", ["one pass", "short passes"])
@pytest.mark.parametrize("width", [1, 48, 100, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_y_and_dx_on_the_panel_gemm_are_the_products_and_thread_counts_agree_bitwise(
        passes, width, dtype, rng):
    # N = 11 leaves a partial row panel; out = 70 and in = 130 a whole strip of 48 floats
    # (AVX-512; transposed 16 x 16 at a time for y, with a rest) and a partial one. Widths
    # below, at and past a strip, and past both (one block); the depth in one pass, or in
    # 2-3 passes that start inside w's rows and add to c.
    x = rng.standard_normal((11, 130)).astype(dtype)
    w = rng.standard_normal((70, 130)).astype(dtype)
    b = rng.standard_normal(70).astype(dtype)
    dy = rng.standard_normal((11, 70)).astype(dtype)
    cut = (linear.PANELS, width)

    def run():
        y, dx = np.full((11, 70), np.nan, dtype), np.full_like(x, np.nan)
        dw = np.zeros_like(w)
        linear.linear_forward(y, x, w, b, cut)
        linear.linear_backward(dx, dw, None, dy, x, w, dx_cut=cut)
        return y, dx

    before = conv.panel_block_bytes(SHORT_PASSES if passes == "short passes" else 0)
    try:
        one, two = at_thread_counts(run)
    finally:
        conv.panel_block_bytes(before)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for got, again, want in zip(one, two, (x64 @ w64.T + b, dy64 @ w64)):
        np.testing.assert_array_equal(got, again)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("cut", [(linear.PANELS, 64), (3, 64), (linear.ROWS, 0),
                                 (linear.COLS, -1), "rows", (linear.ROWS, 64.0), None])
def test_a_bad_cut_is_refused_by_name(cut):
    x, w = np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32)
    y, dy = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="^dw_cut"):
        linear.linear_backward(None, np.zeros_like(w), None, dy, x, w, dw_cut=cut)
    if cut == (linear.PANELS, 64):     # y and dx run on the panel GEMM, dw does not
        return
    with pytest.raises(ValueError, match="^cut"):
        linear.linear_forward(y, x, w, None, cut)
    with pytest.raises(ValueError, match="^dx_cut"):
        linear.linear_backward(np.zeros_like(x), np.zeros_like(w), None, dy, x, w, dx_cut=cut)


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


def _valid_args(backward):
    """A valid float32 call of linear_backward (or linear_forward), every argument by name:
    N = 2 samples, 3 input and 4 output features, random values."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    dy, b = rng.standard_normal((2, 4)), rng.standard_normal(4)
    if backward:
        args = dict(dx=np.zeros_like(x), dw=rng.standard_normal(w.shape), db=b, dy=dy, x=x, w=w)
    else:
        args = dict(y=np.zeros_like(dy), x=x, w=w, b=b)
    return {name: value.astype(np.float32) for name, value in args.items()}


def _accepts(args):
    """Whether linear_forward/backward must compute `args` (else refuse them), decided from
    the arguments: x (N, in) and w (out, in) non-empty float arrays of one dtype, every other
    array of that dtype and its shape, all C-contiguous and aligned; outputs writeable and
    sharing no memory with another argument; dx, b and db may be None."""
    x, w = args["x"], args["w"]
    dtype = float_dtype(x)
    if not (is_array(x, dtype, ndim=2) and is_array(w, dtype, ndim=2)) \
            or x.size == 0 or w.size == 0 or w.shape[1] != x.shape[1]:
        return False
    (n, features), outputs = x.shape, w.shape[0]
    shapes = dict(y=(n, outputs), dx=(n, features), dw=w.shape, b=(outputs,), db=(outputs,),
                  dy=(n, outputs))
    optional = {"dx", "b", "db"}
    written = {"y", "dx", "dw", "db"} & set(args)
    return all(args[name] is None and name in optional
               or is_array(args[name], dtype, shapes[name], output=name in written)
               for name in shapes.keys() & set(args)) and not overlap(args, written)


def _assert_computed(before, args):
    """The outputs in `args` after the call are those of `before`'s inputs (float64 sums)."""
    x, w = before["x"].astype(np.float64), before["w"].astype(np.float64)
    tolerance = dict(rtol=1e-5, atol=1e-6)
    if "y" in args:
        b = 0 if before["b"] is None else before["b"]
        np.testing.assert_allclose(args["y"], x @ w.T + b, **tolerance)
        return
    dy = before["dy"].astype(np.float64)
    np.testing.assert_allclose(args["dw"], before["dw"] + dy.T @ x, **tolerance)
    if args["dx"] is not None:
        np.testing.assert_allclose(args["dx"], dy @ w, **tolerance)
    if args["db"] is not None:
        np.testing.assert_allclose(args["db"], before["db"] + dy.sum(axis=0), **tolerance)


@settings(max_examples=300, deadline=None)
@given(backward=st.booleans(), data=st.data())
def test_linear_bad_input_always_raises_a_python_exception(backward, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # None for an optional argument, a read-only input), the others must be refused.
    args = data.draw(spoiled_calls(_valid_args(backward)))
    call = linear.linear_backward if backward else linear.linear_forward
    ran = run_spoiled(call, args, _accepts(args))
    if ran:
        _assert_computed(ran[0], args)
