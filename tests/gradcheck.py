"""Central-difference gradient checker shared by every kernel and layer test (as Caffe's).

A scalar loss L = sum(output * projection) with a fixed random projection turns any op into
a function of its inputs; its analytic gradient w.r.t. the output is the projection itself.
The checker perturbs every element of an input in float64 and compares
(L(x + eps) - L(x - eps)) / (2 eps) with what the op's backward produced.
"""
import numpy as np

# float64 central differences with eps=1e-6 are accurate to ~1e-9 relative on smooth ops;
# max pool and ReLU have kinks, which the tests keep away from (distinct, non-zero inputs).
EPS = 1e-6
RTOL = 1e-5
ATOL = 1e-7


def numerical_gradient(loss, x, eps=EPS):
    """d loss() / d x by central differences, perturbing x in place (restored after)."""
    grad = np.zeros_like(x, dtype=np.float64)
    flat = x.reshape(-1)
    g = grad.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        up = loss()
        flat[i] = orig - eps
        down = loss()
        flat[i] = orig
        g[i] = (up - down) / (2 * eps)
    return grad


def assert_gradient(name, analytic, loss, x, eps=EPS, rtol=RTOL, atol=ATOL):
    numeric = numerical_gradient(loss, x, eps)
    np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol,
                               err_msg=f"gradient of {name} differs from central differences")
