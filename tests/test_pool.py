import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import pool
from gradcheck import assert_gradient
from support import assert_zero_sizes_rejected, at_thread_counts, require_torch
from support.bad_inputs import as_int, float_dtype, is_array, overlap, run_spoiled, spoiled_calls

# (N, C, H, W, kernel, stride, padding): stride = kernel (None), 1 and 2, padding 0/1/2, odd
# and rectangular inputs, batch 1, non-square kernels, overlapping windows, a kernel as large
# as the padded input.
GRAD_CASES = [
    (2, 3, 6, 6, 2, None, 0),
    (1, 2, 7, 5, 3, 2, 1),
    (2, 2, 5, 7, (2, 3), 1, (1, 1)),
    (1, 1, 9, 8, 5, (2, 1), 2),
    (3, 2, 5, 5, 3, 1, 0),
    (1, 2, 7, 7, (3, 1), (1, 2), (1, 0)),
    (1, 1, 3, 3, 5, 1, 2),
    (2, 1, 4, 6, (4, 6), None, 0),
]


def _distinct(rng, shape):
    # Max pool has kinks where two elements tie: distinct values 0.1 apart stay far from any
    # tie under the checker's 1e-6 perturbations.
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 1.0).astype(np.float64)


def _maxpool(x, kernel, stride, padding, dy=None):
    shape = pool.pool2d_output_shape(x.shape, kernel, stride, padding)
    y, argmax = np.empty(shape, x.dtype), np.empty(shape, np.int64)
    pool.maxpool2d_forward(y, argmax, x, kernel, stride, padding)
    dx = None
    if dy is not None:
        dx = np.empty_like(x)
        pool.maxpool2d_backward(dx, dy, argmax)
    return y, argmax, dx


def _avgpool(x, kernel, stride, padding, dy=None):
    y = np.empty(pool.pool2d_output_shape(x.shape, kernel, stride, padding), x.dtype)
    pool.avgpool2d_forward(y, x, kernel, stride, padding)
    dx = None
    if dy is not None:
        dx = np.empty_like(x)
        pool.avgpool2d_backward(dx, dy, kernel, stride, padding)
    return y, dx


def _global(x, dy=None):
    y = np.empty(x.shape[:2], x.dtype)
    pool.global_avgpool_forward(y, x)
    dx = None
    if dy is not None:
        dx = np.empty_like(x)
        pool.global_avgpool_backward(dx, dy)
    return y, dx


@pytest.mark.parametrize("case", GRAD_CASES)
def test_maxpool2d_gradient_matches_central_differences(case, rng):
    N, C, H, W, kernel, stride, padding = case
    x = _distinct(rng, (N, C, H, W))
    proj = rng.standard_normal(pool.pool2d_output_shape(x.shape, kernel, stride, padding))
    dx = _maxpool(x, kernel, stride, padding, proj)[2]
    assert_gradient("x", dx, lambda: float(np.sum(_maxpool(x, kernel, stride, padding)[0] * proj)), x)


@pytest.mark.parametrize("case", GRAD_CASES)
def test_avgpool2d_gradient_matches_central_differences(case, rng):
    N, C, H, W, kernel, stride, padding = case
    x = rng.standard_normal((N, C, H, W))
    proj = rng.standard_normal(pool.pool2d_output_shape(x.shape, kernel, stride, padding))
    dx = _avgpool(x, kernel, stride, padding, proj)[1]
    assert_gradient("x", dx, lambda: float(np.sum(_avgpool(x, kernel, stride, padding)[0] * proj)), x)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 1, 1), (1, 2, 4, 4)])
def test_global_avgpool_gradient_matches_central_differences(shape, rng):
    x = rng.standard_normal(shape)
    proj = rng.standard_normal(shape[:2])
    dx = _global(x, proj)[1]
    assert_gradient("x", dx, lambda: float(np.sum(_global(x)[0] * proj)), x)


def test_maxpool2d_ties_padding_and_nan_follow_pytorch():
    x = np.array([[[[1.0, 3.0, 3.0, -np.inf],
                    [3.0, 0.0, np.nan, np.nan],
                    [-np.inf, -np.inf, 2.0, 2.0]]]])
    y, argmax, _ = _maxpool(x, 2, 1, 0)
    # Ties keep the first in row-major order; NaN wins and the last NaN gives the index.
    np.testing.assert_array_equal(y, [[[[3.0, np.nan, np.nan], [3.0, np.nan, np.nan]]]])
    np.testing.assert_array_equal(argmax, [[[[1, 6, 7], [4, 6, 7]]]])
    # Padding counts as -inf: an all -inf window picks its first real element, never padding.
    y, argmax, _ = _maxpool(np.full((1, 1, 2, 2), -np.inf), 3, 1, 1)
    np.testing.assert_array_equal(argmax, [[[[0, 0], [0, 0]]]])


@pytest.mark.parametrize("width", [3, 9, 14, 28, 33, 67])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool2d_2x2_stride_2_fast_path_keeps_the_tie_and_nan_rules(dtype, width, rng):
    # 2x2 at stride 2 runs a vectorized kernel in fixed-width chunks, the last one overlapping
    # (include/maxpool_row.h): output rows of 1-3, 4-7, 8-15 and 16+ take different paths.
    # The rules are the generic loop's above.
    x = rng.integers(-2, 3, size=(2, 3, 7, width)).astype(dtype)   # many ties; odd sizes
    x[rng.random(x.shape) < 0.05] = np.nan
    x[rng.random(x.shape) < 0.05] = -np.inf
    y, argmax, _ = _maxpool(x, 2, 2, 0)
    ho, wo = y.shape[2:]
    oh, ow = np.meshgrid(np.arange(ho), np.arange(wo), indexing="ij")
    best = np.full(y.shape, -np.inf)
    at = np.broadcast_to(2 * oh * width + 2 * ow, y.shape).copy()
    for dh, dw in ((0, 0), (0, 1), (1, 0), (1, 1)):   # the window in row-major order
        v = x[:, :, 2 * oh + dh, 2 * ow + dw]
        take = (v > best) | np.isnan(v)
        best = np.where(take, v, best)
        at = np.where(take, (2 * oh + dh) * width + 2 * ow + dw, at)
    np.testing.assert_array_equal(argmax, at)
    np.testing.assert_array_equal(y, best.astype(dtype))


def test_maxpool2d_backward_accumulates_overlapping_windows():
    x = np.zeros((1, 1, 3, 3))
    x[0, 0, 1, 1] = 5.0          # the max of all four overlapping 2x2 windows
    dy = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    dx = _maxpool(x, 2, 1, 0, dy)[2]
    expected = np.zeros_like(x)
    expected[0, 0, 1, 1] = 10.0
    np.testing.assert_array_equal(dx, expected)


def test_avgpool2d_counts_padding_in_the_divisor():
    y = _avgpool(np.ones((1, 1, 2, 2)), 3, 1, 1)[0]
    np.testing.assert_allclose(y, np.full((1, 1, 2, 2), 4 / 9), rtol=1e-15)


def _random_parity_cases(count, seed=7):
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        kh, kw = (int(k) for k in rng.integers(1, 6, size=2))
        stride = None if rng.integers(3) == 0 else tuple(int(s) for s in rng.integers(1, 4, size=2))
        padding = (int(rng.integers(0, kh // 2 + 1)), int(rng.integers(0, kw // 2 + 1)))
        H = int(rng.integers(max(1, kh - 2 * padding[0]), 16))
        W = int(rng.integers(max(1, kw - 2 * padding[1]), 16))
        op = ("max", "avg", "global")[i % 3]
        cases.append((op, int(rng.integers(1, 5)), int(rng.integers(1, 7)), H, W,
                      (kh, kw), stride, padding))
    return cases


@pytest.mark.parametrize("case", _random_parity_cases(60))
def test_pool_float32_matches_pytorch(case, rng):
    torch = require_torch()
    F = torch.nn.functional
    op, N, C, H, W, kernel, stride, padding = case
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    if op == "max":
        yt, it = F.max_pool2d(xt, kernel, stride, padding, return_indices=True)
    elif op == "avg":
        yt = F.avg_pool2d(xt, kernel, stride, padding)
    else:
        yt = F.adaptive_avg_pool2d(xt, 1).reshape(N, C)
    dy = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.tensor(dy))
    if op == "max":
        y, argmax, dx = _maxpool(x, kernel, stride, padding, dy)
        # A max selects an element: value and index must be exact.
        np.testing.assert_array_equal(y, yt.detach().numpy())
        np.testing.assert_array_equal(argmax, it.numpy())
    elif op == "avg":
        y, dx = _avgpool(x, kernel, stride, padding, dy)
    else:
        y, dx = _global(x, dy)
    # Sums of O(1) float32 values, possibly in another order than torch's: a few ulps.
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_pool_thread_count_one_vs_two_is_bitwise(rng):
    x = rng.standard_normal((3, 7, 13, 11)).astype(np.float32)
    dy_pool = rng.standard_normal(pool.pool2d_output_shape(x.shape, 3, 2, 1)).astype(np.float32)
    dy_global = rng.standard_normal((3, 7)).astype(np.float32)

    def run():
        return (*_maxpool(x, 3, 2, 1, dy_pool), *_avgpool(x, 3, 2, 1, dy_pool),
                *_global(x, dy_global))

    one, two = at_thread_counts(lambda: run())
    # Each plane is computed by one thread from start to end: no result depends on the split.
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_pool2d_output_shape_follows_pytorch_rules():
    assert pool.pool2d_output_shape((2, 3, 7, 6), 2) == (2, 3, 3, 3)
    assert pool.pool2d_output_shape((2, 3, 7, 6), (3, 2), (2, 1), (1, 0)) == (2, 3, 4, 5)
    assert pool.pool2d_output_shape([1, 1, 1, 1], 3, 1, 1) == (1, 1, 1, 1)
    with pytest.raises(ValueError, match="^padding: must be at most half"):
        pool.pool2d_output_shape((1, 1, 8, 8), 3, 1, 2)
    with pytest.raises(ValueError, match="^kernel: 5x5 is larger than the padded input 4x4"):
        pool.pool2d_output_shape((1, 1, 4, 4), 5)
    with pytest.raises(ValueError, match="^kernel: must be >= 1"):
        pool.pool2d_output_shape((1, 1, 4, 4), 0)
    with pytest.raises(ValueError, match="^stride: must be >= 1"):
        pool.pool2d_output_shape((1, 1, 4, 4), 2, (1, -1))
    with pytest.raises(ValueError, match="^padding: unreasonably large"):
        pool.pool2d_output_shape((1, 1, 4, 4), 2, 1, 2 ** 41)
    with pytest.raises(ValueError, match="^x: expected 4 dimensions"):
        pool.pool2d_output_shape((1, 4, 4), 2)
    with pytest.raises(TypeError, match="^x: expected a shape"):
        pool.pool2d_output_shape(4, 2)
    with pytest.raises(TypeError, match="^kernel: expected an int"):
        pool.pool2d_output_shape((1, 1, 4, 4), 2.0)


def test_pool_with_huge_kernel_and_padding_stays_in_bounds():
    # padding <= kernel//2 lets a 2^40 kernel through on a 1x1 input: one window, one element,
    # and a divisor (2^80) no integer type holds.
    x = np.full((1, 1, 1, 1), 3.0)
    k, p = 2 ** 40, 2 ** 39
    assert pool.pool2d_output_shape(x.shape, k, None, p) == (1, 1, 1, 1)
    np.testing.assert_array_equal(_maxpool(x, k, None, p)[0], x)
    y, dx = _avgpool(x, k, None, p, np.ones_like(x))
    np.testing.assert_allclose(y, 3.0 * 2.0 ** -80, rtol=1e-15)
    np.testing.assert_allclose(dx, 2.0 ** -80, rtol=1e-15)


def _valid_args(op, rng=None):
    """A valid float32 call of entry point `op`: its arrays by name (random values if a
    generator is given, else zeros; argmax in range), then its other arguments (kernel,
    stride, padding)."""
    def array(*shape):
        return np.zeros(shape, np.float32) if rng is None else \
            rng.standard_normal(shape).astype(np.float32)

    x, out = array(2, 3, 6, 5), array(2, 3, 3, 2)
    argmax = np.zeros(out.shape, np.int64) if rng is None else rng.integers(0, 30, out.shape)
    if op == "maxpool2d_forward":
        return dict(y=out, argmax=argmax, x=x), (2, None, 0)
    if op == "maxpool2d_backward":
        return dict(dx=x, dy=out, argmax=argmax), ()
    if op == "avgpool2d_forward":
        return dict(y=out, x=x), (2, None, 0)
    if op == "avgpool2d_backward":
        return dict(dx=x, dy=out), (2, None, 0)
    if op == "global_avgpool_forward":
        return dict(y=array(2, 3), x=x), ()
    return dict(dx=x, dy=array(2, 3)), ()


ENTRY_POINTS = ["maxpool2d_forward", "maxpool2d_backward", "avgpool2d_forward",
                "avgpool2d_backward", "global_avgpool_forward", "global_avgpool_backward"]


@pytest.mark.parametrize("op", ENTRY_POINTS)
def test_pool_zero_size_dimensions_are_value_errors_naming_the_argument(op):
    arrays, rest = _valid_args(op)
    assert_zero_sizes_rejected(getattr(pool, op), arrays, rest)


def test_pool_errors_name_the_argument():
    x = np.zeros((1, 2, 4, 4), np.float32)
    y = np.zeros((1, 2, 2, 2), np.float32)
    argmax = np.zeros(y.shape, np.int64)
    with pytest.raises(TypeError, match="^x: "):
        pool.maxpool2d_forward(y, argmax, x.astype(np.int32), 2)
    with pytest.raises(TypeError, match="^y: "):
        pool.maxpool2d_forward(y.astype(np.float64), argmax, x, 2)
    with pytest.raises(TypeError, match="^argmax: "):
        pool.maxpool2d_forward(y, argmax.astype(np.int32), x, 2)
    with pytest.raises(ValueError, match="^y: expected shape"):
        pool.avgpool2d_forward(y, x, 3)
    with pytest.raises(ValueError, match="^x: must be C-contiguous"):
        pool.avgpool2d_forward(y, np.zeros((1, 2, 8, 8), np.float32)[:, :, ::2, ::2], 2)
    with pytest.raises(ValueError, match="^y: output array is read-only"):
        ro = y.copy()
        ro.flags.writeable = False
        pool.avgpool2d_forward(ro, x, 2)
    with pytest.raises(ValueError, match="^dx: expected \\(N, C\\)"):
        pool.maxpool2d_backward(np.zeros((1, 3, 4, 4), np.float32), y, argmax)
    with pytest.raises(ValueError, match="^y: expected shape"):
        pool.global_avgpool_forward(np.zeros((2, 1), np.float32), x)
    with pytest.raises(ValueError, match="^y must not overlap x"):
        flat = np.zeros(2 * x.size, np.float32)
        pool.avgpool2d_forward(flat[:8].reshape(y.shape), flat[:x.size].reshape(x.shape), 2)


@pytest.mark.parametrize("bad", [-1, 16, -2 ** 62])
def test_maxpool2d_backward_refuses_out_of_range_argmax_before_writing(bad):
    dy = np.ones((1, 2, 2, 2), np.float32)
    argmax = np.zeros(dy.shape, np.int64)
    argmax[0, 1, 1, 0] = bad
    dx = np.full((1, 2, 4, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match="^argmax: 1 values outside \\[0, H\\*W\\) = \\[0, 16\\)"):
        pool.maxpool2d_backward(dx, dy, argmax)
    assert (dx == 7.0).all()


def _pair(value, minimum):
    """An int or (h, w) pair as pool2d_output_shape takes kernel, stride and padding, else
    None: ints >= minimum, and at most 2^40."""
    items = value if isinstance(value, (tuple, list)) else (value, value)
    items = [as_int(v) for v in items] if len(items) == 2 else [None]
    if None in items or min(items) < minimum or max(items) > 2 ** 40:
        return None
    return tuple(items)


def _geometry(x_shape, kernel, stride, padding):
    """(N, C, H_out, W_out) for pooling x_shape by kernel, stride, padding, or None where
    pool2d_output_shape must refuse them: x_shape 4 ints in [1, 2^40], the kernel within the
    padded input, padding at most half the kernel (PyTorch's rules)."""
    try:
        dims = [as_int(d) for d in x_shape]
    except TypeError:    # not iterable
        return None
    if len(dims) != 4 or None in dims or not all(1 <= d <= 2 ** 40 for d in dims):
        return None
    k = _pair(kernel, 1)
    s = k if stride is None else _pair(stride, 1)
    p = _pair(padding, 0)
    if None in (k, s, p):
        return None
    (n, c, h, w), (kh, kw), (sh, sw), (ph, pw) = dims, k, s, p
    if ph > kh // 2 or pw > kw // 2 or kh > h + 2 * ph or kw > w + 2 * pw:
        return None
    return n, c, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1


def _accepts(op, args):
    """Whether `op` must compute `args` (else refuse them), decided from the arguments: the
    float arrays of one dtype, 4-D (N, C, H, W) with every dimension >= 1 or (N, C) for
    global pooling's, C-contiguous and aligned; geometry as _geometry, the output of its
    shape; argmax int64 of the output's shape, in [0, H*W) where it is read; outputs
    writeable and sharing no memory with another argument."""
    if op == "pool2d_output_shape":
        return _geometry(*args.values()) is not None
    first = args["x"] if "forward" in op else args["dy"]
    dtype = float_dtype(first)
    ndim = 2 if op == "global_avgpool_backward" else 4
    if not is_array(first, dtype, ndim=ndim) or first.size == 0:
        return False
    written = ["y", "argmax"] if op == "maxpool2d_forward" else ["y" if "forward" in op else "dx"]
    if "backward" in op:
        dx = args["dx"]
        if not is_array(dx, dtype, ndim=4, output=True) or dx.size == 0:
            return False
    if op == "maxpool2d_forward" or op == "avgpool2d_forward":
        out = _geometry(first.shape, args["kernel"], args["stride"], args["padding"])
        shapes = dict(y=out, argmax=out) if op == "maxpool2d_forward" else dict(y=out)
    elif op == "avgpool2d_backward":
        shapes = dict(dy=_geometry(dx.shape, args["kernel"], args["stride"], args["padding"]))
    elif op == "maxpool2d_backward":
        n, c, h, w = dx.shape
        argmax = args["argmax"]
        if (n, c) != first.shape[:2] or not is_array(argmax, np.int64, first.shape) \
                or not ((0 <= argmax) & (argmax < h * w)).all():
            return False
        shapes = {}
    elif op == "global_avgpool_forward":
        shapes = dict(y=first.shape[:2])
    else:
        shapes = dict(dy=dx.shape[:2])
    if None in shapes.values():
        return False
    types = dict(argmax=np.int64)
    return all(is_array(args[name], types.get(name, dtype), shape, output=name in written)
               for name, shape in shapes.items()) and not overlap(args, written)


def _planes(x):
    return x.reshape(-1, x.shape[2], x.shape[3])


def _windows(h, w, geometry, kernel, stride, padding):
    """For each output position (i, j): the flat input indices h * W + w of its window that
    lie inside the input, in row-major order."""
    (kh, kw), (ph, pw) = _pair(kernel, 1), _pair(padding, 0)
    sh, sw = (kh, kw) if stride is None else _pair(stride, 1)
    for i in range(geometry[2]):
        for j in range(geometry[3]):
            rows = [r for r in range(i * sh - ph, i * sh - ph + kh) if 0 <= r < h]
            cols = [c for c in range(j * sw - pw, j * sw - pw + kw) if 0 <= c < w]
            yield i, j, [r * w + c for r in rows for c in cols], kh * kw


def _assert_computed(op, before, args, result):
    """The outputs after the call (`args`, and the result returned) are those of `before`'s
    inputs, by the definitions of pooling, one window at a time in float64."""
    if op == "pool2d_output_shape":
        assert result == _geometry(*args.values())
        return
    pooling = {name: args[name] for name in ("kernel", "stride", "padding") if name in args}
    if op in ("maxpool2d_forward", "avgpool2d_forward"):
        x = before["x"].astype(np.float64)
        want = np.zeros(args["y"].shape)
        argmax = np.zeros(args["y"].shape, np.int64)
        for plane, values in enumerate(_planes(x)):
            flat = values.reshape(-1)
            for i, j, window, area in _windows(*x.shape[2:], want.shape, **pooling):
                if op == "maxpool2d_forward":
                    best = window[int(np.argmax(flat[window]))]   # the first of equal maxima
                    _planes(want)[plane, i, j], _planes(argmax)[plane, i, j] = flat[best], best
                else:
                    _planes(want)[plane, i, j] = flat[window].sum() / area
        np.testing.assert_allclose(args["y"], want, rtol=1e-6)
        if op == "maxpool2d_forward":
            np.testing.assert_array_equal(args["argmax"], argmax)
    elif op in ("maxpool2d_backward", "avgpool2d_backward"):
        dy = before["dy"].astype(np.float64)
        want = np.zeros(args["dx"].shape)
        for plane, grads in enumerate(_planes(dy)):
            flat = _planes(want)[plane].reshape(-1)
            if op == "maxpool2d_backward":
                np.add.at(flat, _planes(before["argmax"])[plane].reshape(-1), grads.reshape(-1))
                continue
            for i, j, window, area in _windows(*want.shape[2:], dy.shape, **pooling):
                flat[window] += grads[i, j] / area
        np.testing.assert_allclose(args["dx"], want, rtol=1e-5, atol=1e-6)
    elif op == "global_avgpool_forward":
        np.testing.assert_allclose(args["y"], before["x"].astype(np.float64).mean(axis=(2, 3)),
                                   rtol=1e-5, atol=1e-6)
    else:
        h, w = args["dx"].shape[2:]
        want = np.broadcast_to(before["dy"][:, :, None, None] / (h * w), args["dx"].shape)
        np.testing.assert_allclose(args["dx"], want, rtol=1e-6)


pair_values = st.one_of(st.integers(-1, 4), st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
                        st.lists(st.integers(0, 3), max_size=3))


@st.composite
def argmax_values(draw):
    """The valid call's argmax with one value replaced, often outside [0, H*W) = [0, 30)."""
    argmax = _valid_args("maxpool2d_backward", np.random.default_rng(0))[0]["argmax"].copy()
    argmax.reshape(-1)[draw(st.integers(0, argmax.size - 1))] = \
        draw(st.one_of(st.integers(-2, 31), st.sampled_from([-2 ** 63, 2 ** 63 - 1])))
    return argmax


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from(ENTRY_POINTS + ["pool2d_output_shape"]), data=st.data())
def test_pool_bad_input_always_raises_a_python_exception(op, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # another kernel, stride or padding that fits, argmax in range), the others must be
    # refused.
    if op == "pool2d_output_shape":
        valid = dict(x_shape=(2, 3, 6, 5), kernel=2, stride=None, padding=0)
    else:
        arrays, rest = _valid_args(op, np.random.default_rng(0))
        valid = dict(arrays, **dict(zip(("kernel", "stride", "padding"), rest)))
    shapes = st.lists(st.integers(0, 7), min_size=3, max_size=5)
    args = data.draw(spoiled_calls(valid, values=dict(
        kernel=pair_values, stride=pair_values, padding=pair_values, argmax=argmax_values(),
        x_shape=st.one_of(shapes.map(tuple), shapes.map(np.array)))))
    ran = run_spoiled(getattr(pool, op), args, _accepts(op, args))
    if ran:
        _assert_computed(op, ran[0], args, ran[1])
