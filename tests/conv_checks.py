"""Running a convolution kernel pair (Winograd, direct, per-tap GEMM) the way its tests compare
it with im2col/GEMM: one call each way, with outputs pre-filled so that overwriting (y, dx) and
accumulating (dw, db) are both checked. A pair is called as fwd(y, x, w, b, padding) and
bwd(dx, dw, db, dy, x, w, padding); a kernel that also takes a stride is bound to one first
(`at_stride`) and the helpers are told which."""
import numpy as np

from dynar.kernels import conv
from gradcheck import assert_gradient


def at_stride(fwd, bwd, stride):
    """The pair fwd(y, x, w, b, stride, padding), bwd(dx, dw, db, dy, x, w, stride, padding)
    bound to one stride."""
    return (lambda y, x, w, b, p: fwd(y, x, w, b, stride, p),
            lambda dx, dw, db, dy, x, w, p: bwd(dx, dw, db, dy, x, w, stride, p))


def run(fwd, bwd, x, w, b, padding, dy, with_dx=True, stride=1):
    """(y, dx, dw, db) of fwd(y, x, w, b, padding) and bwd(dx, dw, db, dy, x, w, padding);
    dw starts at 0.5 and db at 0.25, as documented they are accumulated into."""
    y = np.empty(conv.conv2d_output_shape(x.shape, w.shape, stride, padding), x.dtype)
    fwd(y, x, w, b, padding)
    dx = np.full_like(x, np.nan) if with_dx else None   # documented as overwritten
    dw = np.full_like(w, 0.5)
    db = None if b is None else np.full_like(b, 0.25)
    bwd(dx, dw, db, dy, x, w, padding)
    return y, dx, dw, db


def im2col(x, w, b, padding, dy, with_dx=True, stride=1):
    return run(*at_stride(conv.conv2d_forward, conv.conv2d_backward, stride),
               x, w, b, padding, dy, with_dx, stride)


def inputs(rng, x_shape, w_shape, padding, dtype, bias=True, stride=1):
    """(x, w, b, padding, dy) with weights scaled like a trained layer's."""
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype) if bias else None
    dy = rng.standard_normal(conv.conv2d_output_shape(x_shape, w_shape, stride, padding))
    dy = dy.astype(dtype)
    return x, w, b, padding, dy


def assert_gradients_match_central_differences(fwd, bwd, x, w, b, padding, rng, stride=1):
    """The gradients bwd computes are those of sum(fwd(x, w, b) * proj), a random proj, by
    central differences in float64."""
    proj = rng.standard_normal(conv.conv2d_output_shape(x.shape, w.shape, stride, padding))
    _, dx, dw, db = run(fwd, bwd, x, w, b, padding, proj, stride=stride)

    def loss():
        y = np.empty(proj.shape)
        fwd(y, x, w, b, padding)
        return float(np.sum(y * proj))

    assert_gradient("x", dx, loss, x)
    assert_gradient("w", dw - 0.5, loss, w)
    assert_gradient("b", db - 0.25, loss, b)


def assert_float32_matches_pytorch(torch, fwd, bwd, x, w, b, padding, dy, tol, stride=1):
    """fwd and bwd in float32 against torch.nn.functional.conv2d and autograd; the weight and
    bias gradients, sums over the whole batch, get an absolute tolerance of 1e-3."""
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride, padding)
    yt.backward(torch.tensor(dy))
    y, dx, dw, db = run(fwd, bwd, x, w, b, padding, dy, stride=stride)
    np.testing.assert_allclose(y, yt.detach().numpy(), **tol)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **tol)
    np.testing.assert_allclose(dw - 0.5, wt.grad.numpy(), rtol=tol["rtol"], atol=1e-3)
    np.testing.assert_allclose(db - 0.25, bt.grad.numpy(), rtol=tol["rtol"], atol=1e-3)
