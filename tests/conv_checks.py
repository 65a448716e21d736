"""Running a convolution algorithm (dynar.kernels.im2col, winograd, direct, tapgemm: each has
forward(y, x, w, b, stride, padding) and backward(dx, dw, db, dy, x, w, stride, padding)) the
way its tests compare it with im2col/GEMM: one call each way, with outputs pre-filled so that
overwriting (y, dx) and accumulating (dw, db) are both checked; and the fixture that runs a
test with the products with the weights on the panel GEMM, then on BLAS."""
import numpy as np
import pytest

from dynar.kernels import conv, im2col as im2col_kernel
from gradcheck import assert_gradient


# A panel GEMM pass this short (the shortest it takes, PANEL_MIN_DEPTH columns) makes every
# product deeper than 64 run in several passes, on any machine's L1.
SHORT_PASSES = 256


@pytest.fixture(params=["panel", "blas"])
def weights_gemm(request):
    """Runs the test with the products with the weights (im2col's and Winograd's) on dynar's
    panel GEMM in short passes, then on BLAS (conv.set_panel_gemm); the build's defaults are
    restored after. A test module uses it by importing it."""
    before = conv.set_panel_gemm(request.param == "panel"), conv.panel_block_bytes(SHORT_PASSES)
    yield request.param
    conv.set_panel_gemm(before[0])
    conv.panel_block_bytes(before[1])


def run(kernel, x, w, b, padding, dy, with_dx=True, stride=1):
    """(y, dx, dw, db) of kernel.forward and kernel.backward; dw starts at 0.5 and db at 0.25,
    as documented they are accumulated into."""
    y = np.empty(conv.output_shape(x.shape, w.shape, stride, padding), x.dtype)
    kernel.forward(y, x, w, b, stride, padding)
    dx = np.full_like(x, np.nan) if with_dx else None   # documented as overwritten
    dw = np.full_like(w, 0.5)
    db = None if b is None else np.full_like(b, 0.25)
    kernel.backward(dx, dw, db, dy, x, w, stride, padding)
    return y, dx, dw, db


def im2col(x, w, b, padding, dy, with_dx=True, stride=1):
    return run(im2col_kernel, x, w, b, padding, dy, with_dx, stride)


def inputs(rng, x_shape, w_shape, padding, dtype, bias=True, stride=1):
    """(x, w, b, padding, dy) with weights scaled like a trained layer's."""
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype) if bias else None
    dy = rng.standard_normal(conv.output_shape(x_shape, w_shape, stride, padding))
    dy = dy.astype(dtype)
    return x, w, b, padding, dy


def assert_gradients_match_central_differences(kernel, x, w, b, padding, rng, stride=1):
    """The gradients kernel.backward computes are those of sum(kernel.forward(x, w, b) *
    proj), a random proj, by central differences in float64."""
    proj = rng.standard_normal(conv.output_shape(x.shape, w.shape, stride, padding))
    _, dx, dw, db = run(kernel, x, w, b, padding, proj, stride=stride)

    def loss():
        y = np.empty(proj.shape)
        kernel.forward(y, x, w, b, stride, padding)
        return float(np.sum(y * proj))

    assert_gradient("x", dx, loss, x)
    assert_gradient("w", dw - 0.5, loss, w)
    assert_gradient("b", db - 0.25, loss, b)


def assert_float32_matches_pytorch(torch, kernel, x, w, b, padding, dy, tol, stride=1):
    """kernel in float32 against torch.nn.functional.conv2d and autograd; the weight and
    bias gradients, sums over the whole batch, get an absolute tolerance of 1e-3."""
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride, padding)
    yt.backward(torch.tensor(dy))
    y, dx, dw, db = run(kernel, x, w, b, padding, dy, stride=stride)
    np.testing.assert_allclose(y, yt.detach().numpy(), **tol)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **tol)
    np.testing.assert_allclose(dw - 0.5, wt.grad.numpy(), rtol=tol["rtol"], atol=1e-3)
    np.testing.assert_allclose(db - 0.25, bt.grad.numpy(), rtol=tol["rtol"], atol=1e-3)
