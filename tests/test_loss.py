import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.kernels import loss as ce
from gradcheck import assert_gradient
from support import at_thread_counts, require_torch
from support.bad_inputs import as_real, float_dtype, is_array, overlap, run_spoiled, spoiled_calls

# (N, K): one class (loss identically 0), one sample, two classes, a wider batch.
GRAD_CASES = [(6, 1), (1, 7), (4, 2), (3, 5), (8, 10)]


def _run(logits, labels, scale=1.0):
    probs = np.empty_like(logits)
    value = ce.softmax_cross_entropy_forward(probs, logits, labels)
    dlogits = np.empty_like(logits)
    ce.softmax_cross_entropy_backward(dlogits, probs, labels, scale)
    return value, probs, dlogits


@pytest.mark.parametrize("case", GRAD_CASES)
def test_cross_entropy_gradient_matches_central_differences(case, rng):
    N, K = case
    logits = 3 * rng.standard_normal((N, K))
    labels = rng.integers(0, K, N)
    scale = 0.7        # d(total)/d(mean loss) for a loss scaled before backward

    def loss():
        return scale * ce.softmax_cross_entropy_forward(np.empty_like(logits), logits, labels)

    assert_gradient("logits", _run(logits, labels, scale)[2], loss, logits)


def _random_parity_cases(count, seed=5):
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 33)), int(rng.integers(1, 51)),
             float(rng.choice([0.1, 1.0, 10.0, 100.0]))) for _ in range(count)]


@pytest.mark.parametrize("case", _random_parity_cases(20))
def test_cross_entropy_float32_matches_pytorch(case, rng):
    torch = require_torch()
    N, K, spread = case
    logits = (spread * rng.standard_normal((N, K))).astype(np.float32)
    labels = rng.integers(0, K, N)
    lt = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(lt, torch.tensor(labels))
    ref.backward()
    value, probs, dlogits = _run(logits, labels)
    # Our exponentials and sums run in double, torch's in float32: relative 1e-5 on the loss,
    # absolute 1e-6 on probabilities in [0, 1] and on gradients in [-1/N, 1/N].
    np.testing.assert_allclose(value, ref.item(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs, torch.softmax(lt, 1).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_is_finite_and_matches_pytorch_at_logits_of_1e4(dtype, rng):
    torch = require_torch()
    logits = rng.choice([-1e4, 1e4, 0.0], size=(16, 7)).astype(dtype)
    logits[0] = -1e4                   # all equal: uniform softmax
    logits[1] = [1e4] + [-1e4] * 6     # label 1 below: loss 2e4, probability underflows to 0
    labels = rng.integers(0, 7, 16)
    labels[1] = 1
    lt = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(lt, torch.tensor(labels))
    ref.backward()
    value, probs, dlogits = _run(logits, labels)
    assert np.isfinite(value) and np.isfinite(ref.item())
    np.testing.assert_allclose(value, ref.item(), rtol=1e-6)
    assert np.all(np.isfinite(probs)) and np.all(np.isfinite(dlogits))
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_cross_entropy_backward_scales_by_scale_over_batch(rng):
    logits = rng.standard_normal((4, 3))
    labels = np.array([0, 2, 1, 2])
    _, probs, dlogits = _run(logits, labels, scale=2.5)
    onehot = np.eye(3)[labels]
    np.testing.assert_allclose(dlogits, (probs - onehot) * 2.5 / 4, rtol=1e-14, atol=1e-16)


def test_cross_entropy_thread_count_one_vs_two_is_bitwise(rng):
    logits = rng.standard_normal((64, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 64)
    one, two = at_thread_counts(lambda: _run(logits, labels))
    # Rows are independent and the per-row losses are summed in row order afterwards.
    assert one[0] == two[0]
    np.testing.assert_array_equal(one[1], two[1])
    np.testing.assert_array_equal(one[2], two[2])


@pytest.mark.parametrize("bad", [-1, 5, 2 ** 62])
def test_out_of_range_label_names_labels_and_the_value(bad):
    logits = np.zeros((3, 5), np.float32)
    labels = np.array([0, bad, 1])
    with pytest.raises(ValueError, match=rf"^labels: labels\[1\] = {bad} "):
        ce.softmax_cross_entropy_forward(np.empty_like(logits), logits, labels)
    with pytest.raises(ValueError, match=rf"^labels: labels\[1\] = {bad} "):
        ce.softmax_cross_entropy_backward(np.empty_like(logits), logits, labels)


def test_cross_entropy_errors_name_the_argument():
    logits = np.zeros((3, 5), np.float32)
    labels = np.zeros(3, np.int64)
    probs = np.empty_like(logits)
    with pytest.raises(TypeError, match="^labels"):
        ce.softmax_cross_entropy_forward(probs, logits, labels.astype(np.int32))
    with pytest.raises(ValueError, match="^labels"):
        ce.softmax_cross_entropy_forward(probs, logits, np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="^logits"):
        ce.softmax_cross_entropy_forward(probs, [[0.0] * 5] * 3, labels)
    with pytest.raises(TypeError, match="^probs"):
        ce.softmax_cross_entropy_forward(probs.astype(np.float64), logits, labels)
    with pytest.raises(ValueError, match="^logits: every dimension"):
        ce.softmax_cross_entropy_forward(np.empty((3, 0), np.float32),
                                         np.zeros((3, 0), np.float32), labels)
    with pytest.raises(ValueError, match="overlap"):
        ce.softmax_cross_entropy_forward(logits, logits, labels)
    with pytest.raises(ValueError, match="^dlogits"):
        ce.softmax_cross_entropy_backward(np.empty((3, 4), np.float32), probs, labels)
    with pytest.raises(TypeError, match="^scale"):
        ce.softmax_cross_entropy_backward(np.empty_like(probs), probs, labels, "1")
    with pytest.raises(ValueError, match="^scale"):
        ce.softmax_cross_entropy_backward(np.empty_like(probs), probs, labels, float("inf"))


N, K = 3, 4   # the valid calls' batch and classes


def _valid_args(backward):
    """A valid float32 call of softmax_cross_entropy_backward (or _forward), every argument
    by name: N = 3 samples of K = 4 classes, random values."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((N, K)).astype(np.float32)
    labels = np.array([3, 0, 2], np.int64)
    if backward:
        probs = np.exp(rows) / np.exp(rows).sum(axis=1, keepdims=True)
        return dict(dlogits=np.zeros_like(rows), probs=probs, labels=labels, scale=2.0)
    return dict(probs=np.zeros_like(rows), logits=rows, labels=labels)


# Labels of the right shape, some outside [0, K); the extremes of int64 as well.
label_values = st.lists(st.one_of(st.integers(-1, K), st.sampled_from([-2 ** 63, 2 ** 63 - 1])),
                        min_size=N, max_size=N).map(lambda v: np.array(v, np.int64))


def _accepts(args):
    """Whether softmax_cross_entropy_forward/backward must compute `args` (else refuse them),
    decided from the arguments: logits (forward) or probs (backward) a non-empty (N, K) float
    array; labels int64 (N,) each in [0, K); the output of the same dtype and shape, writeable
    and sharing no memory with another argument; scale (backward) a finite real."""
    rows = args["logits"] if "logits" in args else args["probs"]
    dtype, output = float_dtype(rows), "probs" if "logits" in args else "dlogits"
    if not is_array(rows, dtype, ndim=2) or rows.size == 0:
        return False
    n, k = rows.shape
    labels = args["labels"]
    if not is_array(labels, np.int64, (n,)) or not ((0 <= labels) & (labels < k)).all():
        return False
    if "scale" in args:
        scale = as_real(args["scale"])
        if scale is None or not math.isfinite(scale):
            return False
    return is_array(args[output], dtype, (n, k), output=True) and not overlap(args, [output])


def _assert_computed(before, args, loss):
    """The outputs after the call (`args`, and the loss returned) are those of `before`'s
    inputs: softmax and mean cross-entropy forward, (probs - onehot) * scale / N backward."""
    labels = before["labels"]
    if "logits" in args:
        logits = before["logits"].astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        np.testing.assert_allclose(args["probs"], np.exp(log_probs), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(loss, -log_probs[np.arange(len(labels)), labels].mean(),
                                   rtol=1e-5)
        return
    probs = before["probs"]
    onehot = np.eye(probs.shape[1], dtype=probs.dtype)[labels]
    # scale / N rounded to the probabilities' precision, as the kernel does (a tiny scale
    # becomes 0 in float32).
    coef = probs.dtype.type(as_real(args["scale"]) / len(labels))
    np.testing.assert_allclose(args["dlogits"], (probs - onehot) * coef, rtol=1e-6)


@settings(max_examples=300, deadline=None)
@given(backward=st.booleans(), data=st.data())
def test_cross_entropy_bad_input_always_raises_a_python_exception(backward, data):
    # A valid call with 1 to 3 arguments replaced: some replacements keep it valid (a copy,
    # labels in range, a read-only input, another scale), the others must be refused.
    args = data.draw(spoiled_calls(_valid_args(backward),
                                   values={"labels": label_values, "scale": st.floats(-10, 10)}))
    call = ce.softmax_cross_entropy_backward if backward else ce.softmax_cross_entropy_forward
    ran = run_spoiled(call, args, _accepts(args))
    if ran:
        _assert_computed(ran[0], args, ran[1])
