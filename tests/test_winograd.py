import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar import nn
from dynar.kernels import winograd
from dynar.nn import conv_algorithms
import conv_checks
from support import at_thread_counts, require_torch
from conv_checks import weights_gemm  # noqa: F401  (a fixture)

# (N, C_in, H, W, C_out, padding): odd and even planes (partial last tiles), rectangular,
# padding 0/1/2 and per-axis, a 1x1 image with padding, one channel, several images per
# chunk, a plane wide enough to be cut into bands of tile rows, and small planes in chunks
# of >= 8 images (the lane kernels; odd sizes, per-axis padding, a short last chunk);
# channel counts that fill several panels of the panel GEMM and part of another.
CASES = [
    (2, 3, 5, 7, 4, 1),
    (3, 5, 6, 6, 2, 0),
    (2, 2, 1, 1, 3, 1),
    (1, 4, 9, 4, 3, 2),
    (2, 1, 8, 8, 1, (1, 0)),
    (9, 6, 4, 4, 5, 1),
    (2, 8, 33, 31, 6, 1),
    (2, 13, 6, 6, 19, 1),
    (1, 2, 70, 80, 2, 1),
    (17, 2, 5, 3, 3, 1),
    (16, 3, 6, 7, 2, (0, 2)),
    (40, 4, 2, 2, 3, 1),
]
LANE_CASES = CASES[-3:]


def _winograd(x, w, b, padding, dy, with_dx=True):
    return conv_checks.run(winograd, x, w, b, padding, dy, with_dx)


_im2col = conv_checks.im2col


def _inputs(rng, case, dtype, bias=True):
    N, C, H, W, Co, padding = case
    return conv_checks.inputs(rng, (N, C, H, W), (Co, C, 3, 3), padding, dtype, bias)


@pytest.mark.parametrize("case", CASES)
def test_winograd_equals_im2col_in_float64(case, weights_gemm, rng):
    # The transforms are exact up to rounding: float64 agrees to ~1e-15 relative.
    args = _inputs(rng, case, np.float64)
    for name, got, want in zip(("y", "dx", "dw", "db"), _winograd(*args), _im2col(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("case", CASES[:5] + LANE_CASES[:1])
def test_winograd_gradients_match_central_differences(case, rng):
    x, w, b, padding, _ = _inputs(rng, case, np.float64)
    conv_checks.assert_gradients_match_central_differences(winograd, x, w, b, padding, rng)


# float32 tolerance: F(2x2, 3x3)'s transforms add up to 4 terms before and after the
# channel sums, so its rounding error is a small multiple of im2col's (measured: max
# relative error ~7e-7 of the output's magnitude at 64 channels).
F32_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [(4, 64, 16, 16, 32, 1), (3, 16, 9, 11, 8, 1),
                                  (64, 32, 4, 4, 16, 1)])
def test_winograd_float32_matches_pytorch(case, weights_gemm, rng):
    torch = require_torch()
    x, w, b, padding, dy = _inputs(rng, case, np.float32)
    conv_checks.assert_float32_matches_pytorch(torch, winograd, x, w, b, padding, dy, F32_TOL)


def test_winograd_without_bias_or_input_gradient(rng):
    x, w, _, padding, dy = _inputs(rng, (3, 4, 6, 6, 5, 1), np.float64, bias=False)
    y, dx, dw, db = _winograd(x, w, None, padding, dy, with_dx=False)
    y2, _, dw2, _ = _im2col(x, w, None, padding, dy, with_dx=False)
    assert dx is None and db is None
    np.testing.assert_allclose(y, y2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw2, rtol=1e-12, atol=1e-12)


# The last: 70 output channels on 4x4 maps, bias sums in blocks of 64 + 6 channels on one
# thread and 35 + 35 on two.
@pytest.mark.parametrize("case", [(3, 16, 32, 32, 8, 1), (64, 32, 2, 2, 16, 1),
                                  (5, 8, 4, 4, 70, 1)])
def test_winograd_thread_count_one_vs_two(case, rng):
    args = _inputs(rng, case, np.float32)
    one, two = at_thread_counts(lambda: _winograd(*args))
    # Forward and input gradient are bitwise thread-independent where a chunk is one image
    # at any thread count (>= 256 tiles per image); the weight gradient sums per-thread
    # partials; each bias gradient is one channel's sum in an order fixed by the shape.
    for name, a, b in zip(("y", "dx", "dw", "db"), one, two):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_array_equal(one[3], two[3])
    if case[2] * case[3] >= 4 * 256:
        np.testing.assert_array_equal(one[0], two[0])
        np.testing.assert_array_equal(one[1], two[1])


def test_winograd_rejects_other_kernels_and_strides():
    x = np.zeros((1, 2, 8, 8), np.float32)
    y = np.zeros((1, 3, 6, 6), np.float32)
    with pytest.raises(ValueError, match="3x3 kernel at stride 1"):
        winograd.forward(np.zeros((1, 3, 4, 4), np.float32), x,
                         np.zeros((3, 2, 5, 5), np.float32), None, 1, 0)
    with pytest.raises(ValueError, match="3x3 kernel at stride 1"):
        winograd.forward(np.zeros((1, 3, 3, 3), np.float32), x,
                         np.zeros((3, 2, 3, 3), np.float32), None, 2, 0)
    with pytest.raises(ValueError, match="y: expected shape"):
        winograd.forward(y, x, np.zeros((3, 2, 3, 3), np.float32), None, 1, 1)
    with pytest.raises(TypeError, match="w: expected dtype"):
        winograd.forward(y, x, np.zeros((3, 2, 3, 3)), None, 1, 0)
    with pytest.raises(ValueError, match="padding"):
        winograd.backward(None, np.zeros((3, 2, 3, 3), np.float32), None, y, x,
                          np.zeros((3, 2, 3, 3), np.float32), 1, -1)
    assert not winograd.supports((3, 2, 3, 3), 2)
    assert not winograd.supports((3, 2, 5, 5), 1)
    assert winograd.supports((3, 2, 3, 3), (1, 1), 4)


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 3), C=st.integers(1, 5), H=st.integers(1, 12), W=st.integers(1, 12),
       Co=st.integers(1, 4), ph=st.integers(0, 2), pw=st.integers(0, 2))
def test_winograd_equals_im2col_on_any_shape(N, C, H, W, Co, ph, pw):
    if H + 2 * ph < 3 or W + 2 * pw < 3:
        return
    args = _inputs(np.random.default_rng(N * 1000 + H * 10 + W), (N, C, H, W, Co, (ph, pw)),
                   np.float64)
    for got, want in zip(_winograd(*args), _im2col(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("x_shape, w_shape, stride, preferred", [
    ((64, 64, 32, 32), (64, 64, 3, 3), 1, "winograd"),
    ((64, 64, 4, 4), (64, 64, 3, 3), 1, "winograd"),
    ((64, 64, 2, 2), (64, 64, 3, 3), 1, "tapgemm"),     # 2x2 outputs: mostly padding
    ((64, 8, 16, 16), (256, 8, 3, 3), 1, "gemm"),      # too few input channels
    ((64, 64, 32, 32), (64, 64, 3, 3), 2, "gemm"),
])
def test_winograd_preferred_where_measured_faster(x_shape, w_shape, stride, preferred):
    assert conv_algorithms.preferred(x_shape, w_shape, stride, 1) == preferred


def test_conv2d_layer_picks_winograd_where_preferred_and_both_agree(rng):
    layer = nn.Conv2d(64, 32, 3, padding=1, generator=rng)
    x = rng.standard_normal((2, 64, 16, 16)).astype(np.float32)
    dy = rng.standard_normal((2, 32, 16, 16)).astype(np.float32)
    results = {}
    for algorithm in ("auto", "gemm", "winograd"):
        layer.algorithm = algorithm
        layer.zero_grad()
        y = layer.forward(x).copy()
        dx = layer.backward(dy)
        results[algorithm] = (y, None if dx is None else dx.copy(), layer.weight.grad.copy())
        assert layer.kernel == ("gemm" if algorithm == "gemm" else "winograd")
    for a, b in zip(results["winograd"], results["gemm"]):
        if a is not None:
            np.testing.assert_allclose(a, b, **F32_TOL)
    with pytest.raises(ValueError, match="algorithm"):
        layer.algorithm = "fft"
    with pytest.raises(ValueError, match="winograd needs a 3x3 kernel"):
        nn.Conv2d(2, 2, 3, stride=2).algorithm = "winograd"
