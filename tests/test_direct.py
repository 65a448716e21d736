import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar import nn
from dynar.kernels import direct
from dynar.nn import conv_algorithms
import conv_checks
from support import at_thread_counts, require_torch

# (N, C_in, H, W, C_out, kh, kw, padding): LeNet's two layers; 3x3 and 1x1 kernels;
# rectangular kernels and planes, per-axis padding; a kernel as large as the padded input;
# output-channel counts that leave every remainder of the register blocks (1-6 channels,
# 1-4 taps past a run of 5); planes whose positions end mid-vector and mid-block.
CASES = [
    (2, 1, 28, 28, 6, 5, 5, 2),
    (3, 6, 14, 14, 16, 5, 5, 0),
    (2, 3, 9, 7, 5, 3, 3, 1),
    (2, 4, 6, 5, 7, 1, 1, 0),
    (1, 2, 5, 8, 9, 2, 4, (1, 0)),
    (2, 2, 3, 3, 11, 5, 5, 1),
    (3, 5, 1, 1, 13, 1, 1, 0),
    (2, 3, 12, 10, 4, 7, 9, (3, 4)),
    (1, 2, 20, 19, 3, 3, 6, (0, 2)),
]


def _direct(x, w, b, padding, dy, with_dx=True):
    return conv_checks.run(direct, x, w, b, padding, dy, with_dx)


def _inputs(rng, case, dtype, bias=True):
    N, C, H, W, Co, kh, kw, padding = case
    return conv_checks.inputs(rng, (N, C, H, W), (Co, C, kh, kw), padding, dtype, bias)


@pytest.mark.parametrize("case", CASES)
def test_direct_equals_im2col_in_float64(case, rng):
    # Both sum the same products, in another order: float64 agrees to ~1e-15 relative.
    args = _inputs(rng, case, np.float64)
    for name, got, want in zip(("y", "dx", "dw", "db"), _direct(*args),
                               conv_checks.im2col(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("case", CASES[2:6])
def test_direct_gradients_match_central_differences(case, rng):
    x, w, b, padding, _ = _inputs(rng, case, np.float64)
    conv_checks.assert_gradients_match_central_differences(direct, x, w, b, padding, rng)


# float32: each output sums C_in*kh*kw products in plain order, like im2col's GEMM.
F32_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [(8, 1, 28, 28, 6, 5, 5, 2), (8, 6, 14, 14, 16, 5, 5, 0),
                                  (4, 3, 32, 32, 64, 3, 3, 1), (4, 16, 16, 16, 16, 3, 3, 1)])
def test_direct_float32_matches_pytorch(case, rng):
    torch = require_torch()
    x, w, b, padding, dy = _inputs(rng, case, np.float32)
    conv_checks.assert_float32_matches_pytorch(torch, direct, x, w, b, padding, dy, F32_TOL)


def test_direct_without_bias_or_input_gradient(rng):
    x, w, _, padding, dy = _inputs(rng, (3, 4, 6, 6, 5, 3, 3, 1), np.float64, bias=False)
    y, dx, dw, db = _direct(x, w, None, padding, dy, with_dx=False)
    y2, _, dw2, _ = conv_checks.im2col(x, w, None, padding, dy, with_dx=False)
    assert dx is None and db is None
    np.testing.assert_allclose(y, y2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw2, rtol=1e-12, atol=1e-12)


def test_direct_thread_count_one_vs_two(rng):
    args = _inputs(rng, (5, 6, 14, 14, 16, 5, 5, 0), np.float32)
    one, two = at_thread_counts(lambda: _direct(*args))
    # Every image is computed by one thread start to finish, so forward and input gradient
    # are bitwise thread-independent; weight and bias gradients sum per-thread partials.
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])
    for name, a, b in zip(("dw", "db"), one[2:], two[2:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)


def test_direct_is_deterministic_and_ignores_what_is_past_the_plane(rng):
    # The padded planes and their tails are workspace reused across calls: a call after a
    # larger one (whose values are left there) must give the same bits as the first.
    args = _inputs(rng, (3, 6, 14, 14, 16, 5, 5, 0), np.float32)
    first = _direct(*args)
    _direct(*_inputs(rng, (4, 8, 30, 30, 16, 5, 5, 2), np.float32))
    for a, b in zip(first, _direct(*args)):
        np.testing.assert_array_equal(a, b)


def test_direct_rejects_strides_and_bad_arguments():
    x = np.zeros((1, 2, 8, 8), np.float32)
    y = np.zeros((1, 3, 6, 6), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    assert not direct.supports(w.shape, 2)
    assert not direct.supports(w.shape, (1, 2))
    assert direct.supports(w.shape, (1, 1), 3)
    with pytest.raises(ValueError, match="direct: needs stride 1"):
        direct.forward(np.zeros((1, 3, 3, 3), np.float32), x, w, None, 2, 0)
    with pytest.raises(ValueError, match="y: expected shape"):
        direct.forward(y, x, w, None, 1, 1)
    with pytest.raises(TypeError, match="w: expected dtype"):
        direct.forward(y, x, w.astype(np.float64), None, 1, 0)
    with pytest.raises(ValueError, match="padding"):
        direct.backward(None, w.copy(), None, y, x, w, 1, -1)
    with pytest.raises(ValueError, match="direct needs stride 1"):
        nn.Conv2d(2, 2, 3, stride=2).algorithm = "direct"


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 3), C=st.integers(1, 5), H=st.integers(1, 12), W=st.integers(1, 12),
       Co=st.integers(1, 9), kh=st.integers(1, 6), kw=st.integers(1, 6), ph=st.integers(0, 3),
       pw=st.integers(0, 3))
def test_direct_equals_im2col_on_any_shape(N, C, H, W, Co, kh, kw, ph, pw):
    if H + 2 * ph < kh or W + 2 * pw < kw:
        return
    args = _inputs(np.random.default_rng(N * 1000 + H * 10 + W),
                   (N, C, H, W, Co, kh, kw, (ph, pw)), np.float64)
    for got, want in zip(_direct(*args), conv_checks.im2col(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, preferred", [
    ((64, 1, 28, 28), (6, 1, 5, 5), 1, 2, True),       # LeNet
    ((64, 6, 14, 14), (16, 6, 5, 5), 1, 0, True),
    ((64, 3, 32, 32), (64, 3, 3, 3), 1, 1, True),      # the 3-channel first layers
    ((64, 16, 8, 8), (16, 16, 3, 3), 1, 1, False),     # 3x3 under 16x16 outputs: Winograd
    ((64, 64, 32, 32), (64, 64, 3, 3), 1, 1, False),   # too many channel pairs
    ((64, 3, 32, 32), (64, 3, 3, 3), 2, 1, False),     # stride 2
])
def test_direct_preferred_where_measured_faster(x_shape, w_shape, stride, padding, preferred):
    if preferred and x_shape[1] * w_shape[0] > direct.PREFERRED_MAX_PAIRS:
        pytest.skip(f"this build prefers the direct kernels up to "
                    f"{direct.PREFERRED_MAX_PAIRS} channel pairs (its vector width)")
    chosen = conv_algorithms.preferred(x_shape, w_shape, stride, padding)
    assert (chosen == "direct") == preferred, chosen
