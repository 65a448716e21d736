import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar import nn
from dynar.kernels import tapgemm
from dynar.nn import conv_algorithms
import conv_checks
from support import at_thread_counts, require_torch

# (N, C_in, H, W, C_out, kh, kw, stride, padding): VGG's 2x2 and AlexNet's 4x4 layers, scaled
# down; channel counts that split into thread blocks with remainders (33, 40); rectangular
# kernels and planes, per-axis stride and padding; strides, whose runs read stride phases
# (odd planes give phases of unequal size);
# taps that read only padding (a 1x1 plane at stride 2: only the centre tap reads it); a
# kernel as large as the padded input; 1x1 kernels; a single image.
CASES = [
    (4, 24, 2, 2, 24, 3, 3, 1, 1),
    (3, 40, 4, 4, 33, 3, 3, 1, 1),
    (2, 3, 5, 7, 5, 3, 2, (1, 2), (2, 0)),
    (4, 6, 8, 8, 5, 3, 3, 2, 1),
    (2, 5, 1, 1, 7, 3, 3, 2, 1),
    (1, 2, 3, 3, 3, 5, 5, 1, 1),
    (2, 20, 6, 5, 18, 1, 1, 1, 0),
    (2, 4, 7, 7, 4, 3, 3, (2, 3), (0, 1)),
    (1, 17, 2, 2, 19, 3, 3, 1, 1),
]


def _inputs(rng, case, dtype, bias=True):
    N, C, H, W, Co, kh, kw, stride, padding = case
    return conv_checks.inputs(rng, (N, C, H, W), (Co, C, kh, kw), padding, dtype, bias, stride)


def _tapgemm(case, args, with_dx=True):
    return conv_checks.run(tapgemm, *args, with_dx, case[7])


def _im2col(case, args, with_dx=True):
    return conv_checks.im2col(*args, with_dx, case[7])


@pytest.mark.parametrize("case", CASES)
def test_tapgemm_equals_im2col_in_float64(case, rng):
    # Both sum the same nonzero products, in another order: float64 agrees to ~1e-15.
    args = _inputs(rng, case, np.float64)
    for name, got, want in zip(("y", "dx", "dw", "db"), _tapgemm(case, args),
                               _im2col(case, args)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]])
def test_tapgemm_gradients_match_central_differences(case, rng):
    x, w, b, padding, _ = _inputs(rng, case, np.float64)
    conv_checks.assert_gradients_match_central_differences(tapgemm, x, w, b, padding, rng,
                                                           case[7])


@pytest.mark.parametrize("case", [(8, 64, 2, 2, 64, 3, 3, 1, 1), (8, 48, 4, 4, 40, 3, 3, 1, 1),
                                  (4, 16, 9, 9, 24, 3, 3, 2, 1)])
def test_tapgemm_float32_matches_pytorch(case, rng):
    torch = require_torch()
    x, w, b, padding, dy = _inputs(rng, case, np.float32)
    conv_checks.assert_float32_matches_pytorch(torch, tapgemm, x, w, b, padding, dy,
                                               dict(rtol=1e-4, atol=1e-4), case[7])


def test_tapgemm_without_bias_or_input_gradient(rng):
    case = (3, 20, 2, 2, 18, 3, 3, 1, 1)
    args = _inputs(rng, case, np.float64, bias=False)
    y, dx, dw, db = _tapgemm(case, args, with_dx=False)
    y2, _, dw2, _ = _im2col(case, args, with_dx=False)
    assert dx is None and db is None
    np.testing.assert_allclose(y, y2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw2, rtol=1e-12, atol=1e-12)


def test_tapgemm_thread_counts_agree_and_repeat_bitwise(rng):
    # A larger call in between leaves its values in the reused workspace; the repeat must not
    # see them.
    case = (5, 40, 4, 4, 36, 3, 3, 1, 1)
    args = _inputs(rng, case, np.float32)
    one, two = at_thread_counts(lambda: _tapgemm(case, args))
    for name, a, b in zip(("y", "dx", "dw", "db"), one, two):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)
    bigger = (6, 48, 4, 4, 48, 3, 3, 1, 1)
    big_args = _inputs(rng, bigger, np.float32)
    def big_then_repeat():          # at two's thread count: only the workspace may differ
        _tapgemm(bigger, big_args)
        return _tapgemm(case, args)
    repeat, = at_thread_counts(big_then_repeat, counts=(2,))
    for a, b in zip(two, repeat):
        np.testing.assert_array_equal(a, b)


def test_tapgemm_rejects_bad_arguments():
    x = np.zeros((1, 2, 4, 4), np.float32)
    y = np.zeros((1, 3, 2, 2), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="y: expected shape"):
        tapgemm.forward(y, x, w, None, 1, 1)
    with pytest.raises(TypeError, match="w: expected dtype"):
        tapgemm.forward(y, x, w.astype(np.float64), None, 1, 0)
    with pytest.raises(ValueError, match="stride"):
        tapgemm.backward(None, w.copy(), None, y, x, w, 0, 0)
    with pytest.raises(ValueError, match="padding"):
        tapgemm.backward(None, w.copy(), None, y, x, w, 1, -1)


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 3), C=st.integers(1, 20), H=st.integers(1, 9), W=st.integers(1, 9),
       Co=st.integers(1, 20), kh=st.integers(1, 5), kw=st.integers(1, 5), sh=st.integers(1, 3),
       sw=st.integers(1, 3), ph=st.integers(0, 3), pw=st.integers(0, 3))
def test_tapgemm_equals_im2col_on_any_shape(N, C, H, W, Co, kh, kw, sh, sw, ph, pw):
    if H + 2 * ph < kh or W + 2 * pw < kw:
        return
    case = (N, C, H, W, Co, kh, kw, (sh, sw), (ph, pw))
    args = _inputs(np.random.default_rng(N * 1000 + H * 10 + W), case, np.float64)
    for got, want in zip(_tapgemm(case, args), _im2col(case, args)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, preferred", [
    ((64, 512, 2, 2), (512, 512, 3, 3), 1, 1, True),    # VGG's last block
    ((64, 16, 2, 2), (16, 16, 3, 3), 1, 1, True),       # any channel count on 2x2
    ((64, 192, 4, 4), (384, 192, 3, 3), 1, 1, True),    # AlexNet's 4x4 layers
    ((64, 128, 4, 4), (128, 128, 3, 3), 1, 1, False),   # too few channels on 4x4
    ((64, 256, 8, 8), (256, 256, 3, 3), 1, 1, False),   # 8x8: Winograd
    ((64, 256, 8, 8), (512, 256, 3, 3), 2, 1, True),    # ResNet's stride-2 layer to 4x4
    ((64, 128, 16, 16), (256, 128, 3, 3), 2, 1, False),  # stride 2 to 8x8: im2col
    ((64, 512, 2, 2), (512, 512, 1, 1), 1, 0, False),   # 1x1: one tap, nothing to skip
])
def test_tapgemm_preferred_where_measured_faster(x_shape, w_shape, stride, padding, preferred):
    chosen = conv_algorithms.preferred(x_shape, w_shape, stride, padding)
    assert (chosen == "tapgemm") == preferred, chosen
