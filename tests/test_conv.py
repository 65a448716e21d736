import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import conv
from gradcheck import assert_gradient
from conftest import at_thread_counts, require_torch

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
    y = np.empty(conv.conv2d_output_shape(x.shape, w.shape, stride, padding), x.dtype)
    conv.conv2d_forward(y, x, w, b, stride, padding)
    dx = np.full_like(x, np.nan)   # dx is documented as overwritten: stale values must not leak
    dw = np.zeros_like(w)
    db = None if b is None else np.zeros_like(b)
    if dy is not None:
        conv.conv2d_backward(dx, dw, db, dy, x, w, stride, padding)
    return y, dx, dw, db


@pytest.mark.parametrize("case", GRAD_CASES)
def test_conv2d_gradients_match_central_differences(case, weights_gemm, rng):
    N, C, H, W, Co, kh, kw, stride, padding = case
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((Co, C, kh, kw))
    b = rng.standard_normal(Co)
    out_shape = conv.conv2d_output_shape(x.shape, w.shape, stride, padding)
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
    conv.conv2d_backward(None, dw, db, dy, x, w, 1, 1)
    fresh_dw, fresh_db = np.zeros_like(w), np.zeros(4)
    conv.conv2d_backward(None, fresh_dw, fresh_db, dy, x, w, 1, 1)
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
# one whose depth (C_in*kh*kw = 810) the panel GEMM covers in two passes.
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


def test_conv2d_errors_name_the_argument():
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    y = np.zeros((1, 4, 6, 6), np.float32)
    with pytest.raises(TypeError, match="x"):
        conv.conv2d_forward(y, x.astype(np.int32), w)
    with pytest.raises(TypeError, match="w"):
        conv.conv2d_forward(y, x, w.astype(np.float64))
    with pytest.raises(ValueError, match="y"):
        conv.conv2d_forward(np.zeros((1, 4, 8, 8), np.float32), x, w)
    with pytest.raises(ValueError, match="C-contiguous"):
        conv.conv2d_forward(y, np.asfortranarray(x), w)
    with pytest.raises(ValueError, match="input channels"):
        conv.conv2d_forward(y, x, np.zeros((4, 2, 3, 3), np.float32))
    with pytest.raises(ValueError, match="larger than the padded input"):
        conv.conv2d_forward(y, x, np.zeros((4, 3, 9, 9), np.float32))
    with pytest.raises(ValueError, match="stride"):
        conv.conv2d_forward(y, x, w, None, 0)
    with pytest.raises(ValueError, match="padding"):
        conv.conv2d_forward(y, x, w, None, 1, -1)
    with pytest.raises(ValueError, match="overlap"):
        conv.conv2d_forward(x[:, :3, :6, :6].copy(), x, w[:3])  # fine: disjoint copy
        conv.conv2d_forward(x.reshape(-1)[:3 * 36].reshape(1, 3, 6, 6), x, w[:3].copy())


arrays = st.one_of(
    st.none(), st.integers(-3, 3), st.floats(allow_nan=True),
    st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 9), st.integers(0, 9),
              st.sampled_from([np.float32, np.float64, np.int64]), st.booleans()).map(
        lambda t: (np.zeros(t[:4], t[4]) if t[5] else np.zeros(t[:4], t[4])[..., ::-1])),
    st.lists(st.integers(0, 5), min_size=1, max_size=5).map(lambda s: np.zeros(s, np.float32)),
)
params = st.one_of(st.integers(-2, 4), st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
                   st.none(), st.floats(), st.text(max_size=2), st.booleans())


@settings(max_examples=300, deadline=None)
@given(y=arrays, x=arrays, w=arrays, b=arrays, stride=params, padding=params,
       backward=st.booleans())
def test_conv2d_bad_input_always_raises_a_python_exception(y, x, w, b, stride, padding, backward):
    try:
        if backward:
            conv.conv2d_backward(y, w, b, y, x, w, stride, padding)
        else:
            conv.conv2d_forward(y, x, w, b, stride, padding)
    except (TypeError, ValueError):
        pass
