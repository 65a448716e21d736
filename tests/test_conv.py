import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import conv
from dynar.kernels import direct, im2col, tapgemm, winograd
from gradcheck import assert_gradient
from support import at_thread_counts, require_torch
from support.bad_inputs import as_int, float_dtype, is_array, overlap, run_spoiled, spoiled_calls
from conv_checks import weights_gemm  # noqa: F401  (a fixture)

# (N, C_in, H, W, C_out, kh, kw, stride, padding): strides 1 and 2, padding 0/1/2, odd and
# rectangular sizes, batch 1, non-square kernels, 1x1, and a kernel as large as the input.
GRAD_CASES = [
    (2, 3, 5, 7, 4, 3, 3, 1, 1),
    (1, 2, 7, 5, 3, 3, 3, 2, 0),
    (2, 2, 6, 6, 3, 2, 3, (2, 1), (1, 2)),
    (1, 3, 5, 5, 2, 1, 1, 1, 0),
    (3, 2, 4, 4, 2, 1, 1, 2, 1),
    (1, 1, 9, 9, 2, 5, 5, 1, 2),
    (2, 2, 3, 3, 2, 3, 3, 1, 0),
    (1, 2, 11, 11, 2, 11, 11, 1, 0),
    (5, 2, 2, 2, 3, 3, 3, 1, 1),    # several images per GEMM
]


def _run(x, w, b, stride, padding, dy):
    y = np.empty(conv.output_shape(x.shape, w.shape, stride, padding), x.dtype)
    im2col.forward(y, x, w, b, stride, padding)
    dx = np.full_like(x, np.nan)   # dx is documented as overwritten: stale values must not leak
    dw = np.zeros_like(w)
    db = None if b is None else np.zeros_like(b)
    if dy is not None:
        im2col.backward(dx, dw, db, dy, x, w, stride, padding)
    return y, dx, dw, db


@pytest.mark.parametrize("case", GRAD_CASES)
def test_conv2d_gradients_match_central_differences(case, weights_gemm, rng):
    N, C, H, W, Co, kh, kw, stride, padding = case
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((Co, C, kh, kw))
    b = rng.standard_normal(Co)
    out_shape = conv.output_shape(x.shape, w.shape, stride, padding)
    proj = rng.standard_normal(out_shape)
    _, dx, dw, db = _run(x, w, b, stride, padding, proj)

    def loss():
        return float(np.sum(_run(x, w, b, stride, padding, None)[0] * proj))

    assert_gradient("x", dx, loss, x)
    assert_gradient("w", dw, loss, w)
    assert_gradient("b", db, loss, b)


def test_conv2d_backward_accumulates_weight_and_bias_gradients(rng):
    x = rng.standard_normal((2, 3, 6, 6))
    w = rng.standard_normal((4, 3, 3, 3))
    dy = rng.standard_normal((2, 4, 6, 6))
    dw, db = np.ones_like(w), np.ones(4)
    im2col.backward(None, dw, db, dy, x, w, 1, 1)
    fresh_dw, fresh_db = np.zeros_like(w), np.zeros(4)
    im2col.backward(None, fresh_dw, fresh_db, dy, x, w, 1, 1)
    np.testing.assert_allclose(dw, fresh_dw + 1, rtol=1e-12)
    np.testing.assert_allclose(db, fresh_db + 1, rtol=1e-12)


def _random_parity_cases(count, seed=2024):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        kh, kw = (int(k) for k in rng.integers(1, 8, size=2))
        sh, sw = (int(s) for s in rng.integers(1, 4, size=2))
        ph, pw = int(rng.integers(0, kh // 2 + 2)), int(rng.integers(0, kw // 2 + 2))
        H, W = int(rng.integers(max(1, kh - 2 * ph), 20)), int(rng.integers(max(1, kw - 2 * pw), 20))
        cases.append((int(rng.integers(1, 6)), int(rng.integers(1, 9)), H, W,
                      int(rng.integers(1, 17)), kh, kw, (sh, sw), (ph, pw), bool(rng.integers(2))))
    return cases


# Shapes where im2col unfolds an image in row tiles (K*W_out large) or batches images, and
# one whose depth (C_in*kh*kw = 810) the panel GEMM covers in passes of unequal length.
TILED_CASES = [(2, 90, 9, 9, 10, 3, 3, (1, 1), (1, 1), True),
               (2, 64, 32, 32, 8, 3, 3, (1, 1), (1, 1), True),
               (2, 32, 31, 33, 4, 5, 5, (2, 1), (2, 0), False),
               (9, 48, 3, 3, 16, 3, 3, (1, 1), (1, 1), True),
               (2, 256, 17, 17, 4, 1, 1, (1, 1), (0, 0), True),
               (16, 8, 4, 4, 8, 1, 1, (1, 1), (0, 0), False)]


@pytest.mark.parametrize("case", _random_parity_cases(60) + TILED_CASES)
def test_conv2d_float32_matches_pytorch(case, weights_gemm, rng):
    torch = require_torch()
    N, C, H, W, Co, kh, kw, stride, padding, bias = case
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((Co, C, kh, kw)) / np.sqrt(C * kh * kw)).astype(np.float32)
    b = rng.standard_normal(Co).astype(np.float32) if bias else None
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride, padding)
    dy = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.tensor(dy))
    y, dx, dw, db = _run(x, w, b, stride, padding, dy)
    # float32 with different summation orders: relative 1e-4 on O(1) values.
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y, yt.detach().numpy(), **tol)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **tol)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-4, atol=1e-3)
    if b is not None:
        np.testing.assert_allclose(db, bt.grad.numpy(), rtol=1e-4, atol=1e-3)


# Stride-2 rows go in vector chunks of 16, 8 or 4 floats (8, 4, 2 doubles) and the rest one
# by one (include/plane_rows.h; im2col's last chunk overlaps the one before, col2im's chunks
# descend in width): widths 1-40 meet every combination, and the first kernel column's rows
# start one element in (it reads the padding there).
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel,padding", [(3, 1), (1, 0), (5, 2)])
def test_conv2d_stride_two_rows_of_every_width(dtype, kernel, padding, rng):
    torch = require_torch()
    for width in range(max(1, kernel - 2 * padding), 41):
        x = rng.standard_normal((2, 3, 5, width)).astype(dtype)
        w = rng.standard_normal((4, 3, kernel, kernel)).astype(dtype)
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
        yt = torch.nn.functional.conv2d(xt, wt, None, 2, padding)
        dy = rng.standard_normal(tuple(yt.shape)).astype(dtype)
        yt.backward(torch.tensor(dy, dtype=torch.float64))
        y, dx, dw, _ = _run(x, w, None, 2, padding, dy)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(y, yt.detach().numpy(), **tol, err_msg=f"width {width}")
        np.testing.assert_allclose(dx, xt.grad.numpy(), **tol, err_msg=f"width {width}")
        np.testing.assert_allclose(dw, wt.grad.numpy(), **tol, err_msg=f"width {width}")


# (shape, per_image): outputs of >= 256 pixels get one GEMM per image, so forward and input
# gradient are bitwise thread-independent; smaller outputs batch ceil(N/threads)-bounded
# groups of images into one GEMM, where BLAS may sum in another order.
@pytest.mark.parametrize("shape,per_image", [((4, 16, 16, 16, 8, 3, 3), True),
                                             ((3, 64, 32, 32, 16, 3, 3), True),
                                             ((64, 32, 2, 2, 16, 3, 3), False)])
def test_conv2d_thread_count_one_vs_two(shape, per_image, rng):
    N, C, H, W, Co, kh, kw = shape
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = rng.standard_normal((Co, C, kh, kw)).astype(np.float32)
    b = rng.standard_normal(Co).astype(np.float32)
    dy = rng.standard_normal((N, Co, H, W)).astype(np.float32)
    one, two = at_thread_counts(lambda: _run(x, w, b, 1, 1, dy))
    # Weight and bias gradients sum per-thread partials: only the summation order changes.
    if per_image:
        np.testing.assert_array_equal(one[0], two[0])
        np.testing.assert_array_equal(one[1], two[1])
    else:
        np.testing.assert_allclose(one[0], two[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(one[1], two[1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(one[2], two[2], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(one[3], two[3], rtol=1e-5, atol=1e-4)


def test_the_panel_gemm_is_blocked_for_this_machines_l1_data_cache():
    # Half the L1d that sysfs reports, checked here against what getconf reports.
    out = subprocess.run(["getconf", "LEVEL1_DCACHE_SIZE"], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip().isdigit() or int(out.stdout) <= 0:
        pytest.skip("getconf does not report the L1 data cache here")
    assert conv.l1_data_cache_bytes() == int(out.stdout)
    assert conv.panel_block_bytes() == int(out.stdout) // 2


def test_the_panel_gemm_gives_the_same_bits_in_any_pass_length(rng):
    # One pass over the whole depth against passes of 64 columns: each sum runs in the same
    # order either way (a pass stores c, the next adds on), so a machine's L1d size never
    # changes a result.
    x = rng.standard_normal((3, 96, 9, 9)).astype(np.float32)         # depth 96 * 9 = 864
    w = (rng.standard_normal((40, 96, 3, 3)) / 30).astype(np.float32)
    dy = rng.standard_normal((3, 40, 9, 9)).astype(np.float32)
    before = conv.set_panel_gemm(True), conv.panel_block_bytes()
    results = []
    try:
        for block in (1 << 20, 256):
            conv.panel_block_bytes(block)
            results.append(_run(x, w, None, 1, 1, dy))
    finally:
        conv.set_panel_gemm(before[0])
        conv.panel_block_bytes(before[1])
    for long_pass, short_pass in zip(*results):
        if long_pass is not None:
            np.testing.assert_array_equal(long_pass, short_pass)


def test_conv2d_errors_name_the_argument():
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    y = np.zeros((1, 4, 6, 6), np.float32)
    with pytest.raises(TypeError, match="x"):
        im2col.forward(y, x.astype(np.int32), w)
    with pytest.raises(TypeError, match="w"):
        im2col.forward(y, x, w.astype(np.float64))
    with pytest.raises(ValueError, match="y"):
        im2col.forward(np.zeros((1, 4, 8, 8), np.float32), x, w)
    with pytest.raises(ValueError, match="C-contiguous"):
        im2col.forward(y, np.asfortranarray(x), w)
    with pytest.raises(ValueError, match="input channels"):
        im2col.forward(y, x, np.zeros((4, 2, 3, 3), np.float32))
    with pytest.raises(ValueError, match="larger than the padded input"):
        im2col.forward(y, x, np.zeros((4, 3, 9, 9), np.float32))
    with pytest.raises(ValueError, match="stride"):
        im2col.forward(y, x, w, None, 0)
    with pytest.raises(ValueError, match="padding"):
        im2col.forward(y, x, w, None, 1, -1)
    with pytest.raises(ValueError, match="overlap"):
        im2col.forward(x[:, :3, :6, :6].copy(), x, w[:3])  # fine: disjoint copy
        im2col.forward(x.reshape(-1)[:3 * 36].reshape(1, 3, 6, 6), x, w[:3].copy())


# -- bad input ----------------------------------------------------------------------------
# Every algorithm's entry points are conv.Algorithm's: one set of checks, run here through all
# four on a 3x3 stride-1 layer, which each of them computes.

def _valid_args(backward, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 4)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    b = rng.standard_normal(4).astype(dtype)
    dy = rng.standard_normal((2, 4, 5, 4)).astype(dtype)
    if backward:
        return dict(dx=np.zeros_like(x), dw=np.ones_like(w), db=np.ones_like(b), dy=dy, x=x,
                    w=w, stride=1, padding=1)
    return dict(y=np.zeros_like(dy), x=x, w=w, b=b, stride=1, padding=1)


def _pair(value, minimum):
    """value as an (h, w) pair of ints >= minimum if the kernels take it for a stride or a
    padding, else None."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2:
        return None
    items = tuple(as_int(v) for v in items)
    if None in items or min(items) < minimum or max(items) > 1 << 40:
        return None
    return items


def _output_shape(args):
    """(N, C_out, H_out, W_out) if x, w, stride and padding make a layer, else None: x
    (N, C_in, H, W) and w (C_out, C_in, kh, kw) non-empty float arrays of one dtype, the
    kernel within the padded input."""
    x, w = args["x"], args["w"]
    dtype = float_dtype(x)
    stride, padding = _pair(args["stride"], 1), _pair(args["padding"], 0)
    if not (is_array(x, dtype, ndim=4) and is_array(w, dtype, ndim=4)) \
            or min(x.shape) < 1 or min(w.shape) < 1 or w.shape[1] != x.shape[1] \
            or stride is None or padding is None:
        return None
    (N, _, H, W), (Co, _, kh, kw) = x.shape, w.shape
    (sh, sw), (ph, pw) = stride, padding
    if kh > H + 2 * ph or kw > W + 2 * pw:
        return None
    return (N, Co, (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1)


def _accepts(algorithm, args):
    """Whether algorithm.forward/backward must compute `args` (else refuse them), decided
    from the arguments: a layer the algorithm supports, every other array of x's dtype and
    its shape, all C-contiguous and aligned; outputs writeable and sharing no memory with
    another argument; b, dx and db may be None."""
    out_shape = _output_shape(args)
    if out_shape is None or not algorithm.supports(args["w"].shape, args["stride"],
                                                   args["padding"]):
        return False
    dtype, Co = args["x"].dtype, out_shape[1]
    shapes = dict(y=out_shape, dy=out_shape, dx=args["x"].shape, dw=args["w"].shape,
                  b=(Co,), db=(Co,))
    optional = {"b", "dx", "db"}
    written = {"y", "dx", "dw", "db"} & set(args)
    return all(args[name] is None and name in optional
               or is_array(args[name], dtype, shapes[name], output=name in written)
               for name in shapes.keys() & set(args)) and not overlap(args, written)


def _taps(x, w, stride, padding):
    """x zero-padded in float64, and for every tap (i, j) the slices of it that the tap reads
    at each output pixel."""
    (sh, sw), (ph, pw) = _pair(stride, 1), _pair(padding, 0)
    kh, kw = w.shape[2:]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    Ho, Wo = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    return xp, {(i, j): (slice(i, i + sh * (Ho - 1) + 1, sh), slice(j, j + sw * (Wo - 1) + 1, sw))
                for i in range(kh) for j in range(kw)}


def _assert_computed(before, args):
    """The outputs in `args` after the call are those of `before`'s inputs (float64 sums)."""
    w = before["w"].astype(np.float64)
    xp, taps = _taps(before["x"], w, before["stride"], before["padding"])
    tol = dict(rtol=1e-4, atol=1e-4)
    if "y" in args:
        y = sum(np.einsum("nchw,oc->nohw", xp[:, :, rows, cols], w[:, :, i, j])
                for (i, j), (rows, cols) in taps.items())
        if before["b"] is not None:
            y = y + before["b"][:, None, None]
        np.testing.assert_allclose(args["y"], y, **tol)
        return
    dy = before["dy"].astype(np.float64)
    dw, dxp = np.zeros_like(w), np.zeros_like(xp)
    for (i, j), (rows, cols) in taps.items():
        dw[:, :, i, j] = np.einsum("nohw,nchw->oc", dy, xp[:, :, rows, cols])
        dxp[:, :, rows, cols] += np.einsum("nohw,oc->nchw", dy, w[:, :, i, j])
    np.testing.assert_allclose(args["dw"], before["dw"] + dw, **tol)
    if args["dx"] is not None:
        (ph, pw), (H, W) = _pair(before["padding"], 0), before["x"].shape[2:]
        np.testing.assert_allclose(args["dx"], dxp[:, :, ph:ph + H, pw:pw + W], **tol)
    if args["db"] is not None:
        np.testing.assert_allclose(args["db"], before["db"] + dy.sum(axis=(0, 2, 3)), **tol)


pairs = st.one_of(st.integers(-2, 4), st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
                  st.lists(st.integers(0, 2), max_size=3), st.none(), st.floats(),
                  st.text(max_size=2), st.booleans())


@settings(max_examples=300, deadline=None)
@given(algorithm=st.sampled_from([im2col, winograd, direct, tapgemm]), backward=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_conv2d_bad_input_always_raises_a_python_exception(algorithm, backward, dtype, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # None for an optional argument, a read-only input, padding (1, 1)), the others must be
    # refused.
    args = data.draw(spoiled_calls(_valid_args(backward, dtype),
                                   values=dict(stride=pairs, padding=pairs)))
    call = algorithm.backward if backward else algorithm.forward
    ran = run_spoiled(call, args, _accepts(algorithm, args))
    if ran:
        _assert_computed(ran[0], args)
