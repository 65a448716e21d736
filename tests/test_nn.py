"""dynar.nn: each layer against torch.nn in float64 on shared weights (outputs, input and
parameter gradients), Module mechanics (registration, state_dict, flat buffers, hooks,
gradient accumulation, train/eval), buffer reuse and bad inputs.

Layer tolerances: float32 against a float64 reference, rtol 1e-4 + atol 1e-5 x max|reference|.
"""
import math
from collections import OrderedDict

import numpy as np
import pytest
from support import require_torch

from dynar import nn


def close(name, got, want, rtol=1e-4, atol_rel=1e-5):
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_rel * np.abs(want).max(),
                               err_msg=name)


def run_layer(layer, twin, x, training=True, torch=None):
    """Forward and backward both layers on x with a random dy; compare output, d(input)
    and every parameter gradient (twin in float64)."""
    rng = np.random.default_rng(1)
    layer.train(training)
    twin.double().train(training)
    y = layer.forward(x).copy()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = layer.backward(dy.copy())
    tx = torch.from_numpy(x).double().requires_grad_()
    ty = twin(tx)
    ty.backward(torch.from_numpy(dy).double())
    close("output", y, ty.detach().numpy())
    close("d(input)", dx, tx.grad.numpy())
    want = dict(twin.named_parameters())
    for name, p in layer.named_parameters():
        close(f"grad of {name}", p.grad, want[name].grad.numpy())
    return y, dx


def load_into_twin(torch, layer, twin):
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in layer.state_dict().items()})


@pytest.mark.parametrize("args,kw,shape", [
    ((3, 5, 3), {}, (2, 3, 9, 8)),
    ((3, 4, (3, 2)), {"stride": 2, "padding": 1}, (3, 3, 11, 10)),
    ((4, 6, 1), {"bias": False}, (2, 4, 5, 5)),
    ((3, 8, 7), {"stride": 2, "padding": 3}, (1, 3, 16, 16)),
])
def test_conv2d_matches_torch(args, kw, shape):
    torch = require_torch()
    layer = nn.Conv2d(*args, **kw, generator=np.random.default_rng(0))
    layer.set_input_requires_grad(True)
    twin = torch.nn.Conv2d(*args, **kw)
    load_into_twin(torch, layer, twin)
    x = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
    run_layer(layer, twin, x, torch=torch)


@pytest.mark.parametrize("layer_args, x_shape, kernel", [
    ((1, 6, 5, 1, 2), (2, 1, 28, 28), "direct"),        # LeNet
    ((6, 16, 5), (2, 6, 14, 14), "direct"),
    ((3, 64, 3, 1, 1), (2, 3, 32, 32), "direct"),       # a first layer of VGG and ResNet
    ((16, 8, 3, 1, 1), (2, 16, 8, 8), "winograd"),      # 3x3 on a small plane
    ((64, 32, 3, 1, 1), (2, 64, 16, 16), "winograd"),   # more channel pairs
    ((24, 20, 3, 1, 1), (3, 24, 2, 2), "tapgemm"),      # a 2x2 plane
    ((3, 8, 3, 2, 1), (2, 3, 16, 16), "gemm"),          # stride 2
])
def test_conv2d_picks_the_preferred_kernel_and_all_kernels_agree(layer_args, x_shape, kernel,
                                                                  rng):
    from dynar.kernels import direct
    if kernel == "direct" and layer_args[0] * layer_args[1] > direct.PREFERRED_MAX_PAIRS:
        pytest.skip(f"this build prefers the direct kernels up to "
                    f"{direct.PREFERRED_MAX_PAIRS} channel pairs (its vector width)")
    layer = nn.Conv2d(*layer_args, generator=rng)
    layer.set_input_requires_grad(True)
    x = rng.standard_normal(x_shape).astype(np.float32)
    results = {}
    for algorithm in nn.conv.ALGORITHMS:
        try:
            layer.algorithm = algorithm
        except ValueError:
            continue   # a kernel that does not compute this layer (checked elsewhere)
        layer.zero_grad()
        y = layer.forward(x).copy()
        dx = layer.backward(np.ones_like(y))
        results[algorithm] = (y, dx.copy(), layer.weight.grad.copy(), layer.bias.grad.copy())
        assert layer.kernel == (kernel if algorithm == "auto" else algorithm)
    assert len(results) >= 3
    for algorithm, got in results.items():
        for a, b in zip(got, results["gemm"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3, err_msg=algorithm)


def test_linear_matches_torch():
    torch = require_torch()
    for bias in (True, False):
        layer = nn.Linear(7, 5, bias=bias, generator=np.random.default_rng(0))
        twin = torch.nn.Linear(7, 5, bias=bias)
        load_into_twin(torch, layer, twin)
        run_layer(layer, twin, np.random.default_rng(3).standard_normal((4, 7), dtype=np.float32),
                  torch=torch)


def test_linear_plan_is_checked_when_set():
    layer = nn.Linear(7, 5)
    layer.plan = "dw=in/16 y=batch/1 dx=batch/1024"     # any order, any width >= 1
    assert layer.plan == "dw=in/16 y=batch/1 dx=batch/1024"
    for bad, what in [("y=out/64 dx=in/64", "misses"), ("y=out/64 dx=out/64 dw=in/64", "got"),
                      ("y=out/0 dx=in/64 dw=in/64", "got"), ("gemm", "got"),
                      ("y=out/64 y=out/64 dx=in/64 dw=in/64", "got")]:
        with pytest.raises(ValueError, match=f"Linear.plan: .*{what}"):
            layer.plan = bad
    assert layer.plan == "dw=in/16 y=batch/1 dx=batch/1024"   # a refused plan changes nothing


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_matches_torch_including_running_stats(training):
    torch = require_torch()
    layer = nn.BatchNorm2d(5, eps=1e-3, momentum=0.3)
    rng = np.random.default_rng(4)
    layer.weight.data[:] = rng.uniform(0.5, 1.5, 5)
    layer.bias.data[:] = rng.normal(0, 1, 5)
    layer.running_mean[:] = rng.normal(0, 1, 5)
    layer.running_var[:] = rng.uniform(0.5, 2, 5)
    twin = torch.nn.BatchNorm2d(5, eps=1e-3, momentum=0.3)
    load_into_twin(torch, layer, twin)
    x = (rng.standard_normal((3, 5, 4, 6)) * 2 + 3).astype(np.float32)
    run_layer(layer, twin, x, training, torch=torch)
    close("running_mean", layer.running_mean, twin.running_mean.numpy(), 1e-5, 1e-6)
    close("running_var", layer.running_var, twin.running_var.numpy(), 1e-5, 1e-6)
    assert layer.num_batches_tracked == twin.num_batches_tracked.item() == int(training)


def test_batchnorm_backward_uses_the_mode_of_its_forward():
    layer = nn.BatchNorm2d(2)
    x = np.random.default_rng(0).standard_normal((2, 2, 3, 3), dtype=np.float32)
    dy = np.random.default_rng(1).standard_normal((2, 2, 3, 3), dtype=np.float32)
    layer.forward(x)
    train_dx = layer.backward(dy).copy()
    layer.forward(x)
    layer.eval()                         # switched between forward and backward
    np.testing.assert_array_equal(layer.backward(dy), train_dx)


@pytest.mark.parametrize("make", [
    lambda t: (nn.MaxPool2d(2), t.nn.MaxPool2d(2)),
    lambda t: (nn.MaxPool2d(3, stride=2, padding=1), t.nn.MaxPool2d(3, 2, 1)),
    lambda t: (nn.AvgPool2d(3, stride=2, padding=1), t.nn.AvgPool2d(3, 2, 1)),
    lambda t: (nn.AvgPool2d(2), t.nn.AvgPool2d(2)),
    lambda t: (nn.AdaptiveAvgPool2d(1), t.nn.AdaptiveAvgPool2d(1)),
    lambda t: (nn.AdaptiveAvgPool2d((7, 6)), t.nn.AdaptiveAvgPool2d((7, 6))),
    lambda t: (nn.ReLU(), t.nn.ReLU()),
    lambda t: (nn.Flatten(), t.nn.Flatten()),
])
def test_parameter_free_layers_match_torch(make):
    torch = require_torch()
    layer, twin = make(torch)
    # distinct values keep max pooling and ReLU away from ties and kinks
    x = np.random.default_rng(5).permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6)
    x = ((x - x.size / 2) / 10).astype(np.float32)
    run_layer(layer, twin, x, torch=torch)


def test_inplace_relu_overwrites_its_input_and_dy():
    relu = nn.ReLU(inplace=True)
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    y = relu.forward(x)
    assert y is x and (x == [[0, 2, 0, 4]]).all()
    dy = np.ones_like(x)
    assert relu.backward(dy) is dy and (dy == [[0, 1, 0, 1]]).all()


def test_adaptive_avgpool_rejects_other_sizes():
    with pytest.raises(ValueError, match=r"AdaptiveAvgPool2d\(\(6, 6\)\).*13x13"):
        nn.AdaptiveAvgPool2d((6, 6)).forward(np.zeros((1, 2, 13, 13), np.float32))


def test_flatten_is_a_view():
    x = np.zeros((2, 3, 4, 5), np.float32)
    f = nn.Flatten()
    y = f.forward(x)
    assert y.shape == (2, 60) and np.shares_memory(x, y)
    assert f.backward(y).shape == x.shape


def test_dropout_train_eval_and_reproducible_from_generator():
    x = np.ones((4, 1000), np.float32)
    a = nn.Dropout(0.3, generator=np.random.default_rng(7))
    b = nn.Dropout(0.3, generator=np.random.default_rng(7))
    ya, yb = a.forward(x).copy(), b.forward(x).copy()
    np.testing.assert_array_equal(ya, yb)
    assert set(np.unique(ya)) == {0, np.float32(1 / 0.7)}
    assert abs((ya == 0).mean() - 0.3) < 0.02
    assert not np.array_equal(a.forward(x), ya)          # a fresh mask every step
    dy = np.full_like(x, 2)
    y = a.forward(x).copy()
    np.testing.assert_allclose(a.backward(dy), np.where(y == 0, 0, 2 / 0.7), rtol=1e-6)
    a.eval()
    assert a.forward(x) is x and a.backward(dy) is dy
    assert nn.Dropout(0.0).forward(x) is x
    with pytest.raises(ValueError, match="p must be in"):
        nn.Dropout(1.0)


def test_cross_entropy_matches_torch():
    torch = require_torch()
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, 7)).astype(np.float32) * 3
    labels = rng.integers(0, 7, 5)
    crit = nn.CrossEntropyLoss()
    loss = crit.forward(logits, labels)
    assert isinstance(loss, float)
    t = torch.from_numpy(logits).double().requires_grad_()
    want = torch.nn.functional.cross_entropy(t, torch.from_numpy(labels))
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    close("dlogits", crit.backward(), t.grad.numpy())


def small_net(seed=0):
    g = np.random.default_rng(seed)
    return nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(2, 4, 3, padding=1, generator=g)),
        ("bn", nn.BatchNorm2d(4)),
        ("relu", nn.ReLU(inplace=True)),
        ("pool", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(16, 3, generator=g)),
    ])).flatten_parameters()


def test_sequential_registration_indexing_and_names():
    seq = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Linear(2, 2))
    assert isinstance(seq[0], nn.Conv2d) and isinstance(seq[-1], nn.Linear) and len(seq) == 3
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    net = small_net()
    assert list(net.state_dict()) == [
        "conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
        "bn.running_var", "bn.num_batches_tracked", "fc.weight", "fc.bias"]
    sd = net.state_dict()
    assert sd["bn.num_batches_tracked"].dtype == np.int64 and sd["bn.num_batches_tracked"].shape == ()
    assert all(v.dtype == np.float32 for k, v in sd.items() if "num_batches" not in k)


def test_default_init_is_torchs():
    conv = nn.Conv2d(8, 16, 3, generator=np.random.default_rng(0))
    bound = 1 / math.sqrt(8 * 9)
    for p in (conv.weight.data, conv.bias.data):     # kaiming_uniform(a=sqrt(5)) = U(+-bound)
        assert np.abs(p).max() <= bound and np.abs(p).max() > 0.95 * bound
    assert abs(conv.weight.data.std() - bound / math.sqrt(3)) < 0.05 * bound
    same = nn.Conv2d(8, 16, 3, generator=np.random.default_rng(0))
    np.testing.assert_array_equal(conv.weight.data, same.weight.data)


def test_flat_buffers_alias_every_parameter_in_backward_order():
    net = small_net()
    assert net.flat_params.dtype == net.flat_grads.dtype == np.float32
    assert net.flat_params.ndim == 1 and net.flat_params.size == sum(p.size for p in net.parameters())
    for p in net.parameters():
        assert np.shares_memory(p.data, net.flat_params) and np.shares_memory(p.grad, net.flat_grads)
    assert [(name, names) for name, names, _, _ in net.grad_ready_order()] == [
        ("fc", ["fc.weight", "fc.bias"]), ("bn", ["bn.weight", "bn.bias"]),
        ("conv", ["conv.weight", "conv.bias"])]
    net.fc.weight.data[0, 0] = 42.0
    assert net.flat_params[0] == 42.0                # fc.weight is first in the buffer
    net.flat_grads[:] = 1
    net.zero_grad()
    assert not net.conv.weight.grad.any()


def test_placed_flat_buffers_carry_forward_and_backward():
    net, twin = small_net(), small_net()
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4), dtype=np.float32)
    dy = np.random.default_rng(1).standard_normal((2, 3), dtype=np.float32)
    params = np.empty_like(net.flat_params)
    params[:] = net.flat_params
    grads = np.zeros_like(net.flat_grads)
    net.place_flat_buffers(params, grads)
    assert net.flat_params is params and net.flat_grads is grads
    for p in net.parameters():
        assert np.shares_memory(p.data, params) and np.shares_memory(p.grad, grads)
        assert p.placement.params is params and p.placement.grads is grads
    np.testing.assert_array_equal(net.forward(x), twin.forward(x))
    net.backward(dy)
    twin.backward(dy)
    np.testing.assert_array_equal(grads, twin.flat_grads)
    with pytest.raises(ValueError, match="flat_grads must be a writeable contiguous float32"):
        net.place_flat_buffers(params, np.zeros(grads.size + 1, np.float32))
    with pytest.raises(ValueError, match="flat_params must be a writeable contiguous"):
        net.place_flat_buffers(np.zeros(2 * params.size, np.float32)[::2], grads)


def test_grad_ready_hooks_fire_once_per_layer_with_final_gradients():
    net = small_net()
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4), dtype=np.float32)
    dy = np.random.default_rng(1).standard_normal((2, 3), dtype=np.float32)
    seen = []
    handle = net.register_grad_ready_hook(
        lambda start, stop: seen.append((start, stop, net.flat_grads[start:stop].copy())))
    net.forward(x)
    net.backward(dy)
    assert [(s, e) for s, e, _ in seen] == [(s, e) for _, _, s, e in net.grad_ready_order()]
    for s, e, snap in seen:
        np.testing.assert_array_equal(snap, net.flat_grads[s:e])
    handle.remove()
    net.forward(x)
    net.backward(dy)
    assert len(seen) == 3


def test_gradients_accumulate_until_zero_grad():
    net = small_net()
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4), dtype=np.float32)
    dy = np.random.default_rng(1).standard_normal((2, 3), dtype=np.float32)
    net.eval()                         # batch statistics unchanged between the two passes
    net.forward(x)
    net.backward(dy)
    once = net.flat_grads.copy()
    net.forward(x)
    net.backward(dy)
    np.testing.assert_allclose(net.flat_grads, 2 * once, rtol=1e-6, atol=1e-7)
    net.zero_grad()
    assert not net.flat_grads.any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lazy_zero_grad_gives_the_eager_gradients_whatever_was_there(precision):
    # ResNet-18 (convolutions, BatchNorm, a fully connected head); two backwards after one
    # zero_grad, as accumulated micro-batches. The lazy model starts from NaN gradients.
    from dynar.models import get
    from dynar.nn.precision import set_precision
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    grads = {}
    for lazy in (False, True):
        model = get("resnet18", num_classes=10, variant="cifar", seed=3)
        set_precision(model, precision)
        model.flat_grads.fill(np.nan)
        model.zero_grad(lazy=lazy)
        for _ in range(2):
            y = model.forward(x)
            model.backward(np.ones_like(y))
        grads[lazy] = model.flat_grads.copy()
    assert np.isfinite(grads[False]).all()
    np.testing.assert_array_equal(grads[True], grads[False])


class _HalfUsed(nn.Module):
    """Two fully connected layers, only one of which forward and backward use."""

    def __init__(self, g):
        super().__init__()
        self.used = nn.Linear(4, 3, generator=g)
        self.unused = nn.Linear(4, 3, generator=g)

    def forward(self, x):
        return self.used.forward(x)

    def backward(self, dy):
        return self.used.backward(dy)


def test_lazy_zero_grad_zeroes_the_layers_backward_did_not_reach():
    from dynar.models.base import Model
    g = np.random.default_rng(0)
    model = Model(OrderedDict(head=_HalfUsed(g)), (4,), g)
    model.flat_grads.fill(np.nan)
    model.zero_grad(lazy=True)
    x = np.ones((2, 4), np.float32)
    model.backward(np.ones_like(model.forward(x)))
    assert not model.head.unused.weight.grad.any() and not model.head.unused.bias.grad.any()
    np.testing.assert_allclose(model.head.used.weight.grad, np.full((3, 4), 2.0))
    np.testing.assert_allclose(model.head.used.bias.grad, np.full(3, 2.0))


class _AddsRegardless(nn.Module):
    """A layer whose backward adds into its gradient without asking whether it is stale."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(np.ones(3, np.float32))

    def forward(self, x):
        self._x = x
        return x * self.scale.data

    def backward(self, dy):
        self.scale.grad += (dy * self._x).sum(axis=0)
        self._grad_ready()
        return dy * self.scale.data


def test_a_layer_that_ignores_a_lazy_zero_grad_is_an_error():
    layer = _AddsRegardless()
    x = np.ones((2, 3), np.float32)
    layer.backward(layer.forward(x))           # eager gradients: fine
    layer.zero_grad(lazy=True)
    layer.forward(x)
    with pytest.raises(RuntimeError, match="_AddsRegardless.backward.*_overwrite_grads"):
        layer.backward(np.ones_like(x))


def test_first_layer_skips_input_gradient_when_input_is_data():
    net = small_net()
    x = np.zeros((2, 2, 4, 4), np.float32)
    net.forward(x)
    assert net.backward(np.ones((2, 3), np.float32)).shape == x.shape
    net.set_input_requires_grad(False)
    assert net.conv.input_requires_grad is False and net.fc.input_requires_grad is True
    net.forward(x)
    assert net.backward(np.ones((2, 3), np.float32)) is None


def test_buffers_are_reused_across_steps_and_reallocated_on_new_shape():
    net = small_net()
    x = np.zeros((2, 2, 4, 4), np.float32)
    y1 = net.forward(x)
    y2 = net.forward(x + 1)
    assert y1 is y2
    assert net.forward(np.zeros((3, 2, 4, 4), np.float32)).shape == (3, 3)


def test_train_eval_switches_every_module():
    net = small_net()
    assert all(m.training for m in net.modules())
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())


def test_load_state_dict_errors_name_the_keys():
    net = small_net()
    sd = net.state_dict()
    del sd["bn.num_batches_tracked"]            # tolerated: older checkpoints lack it
    assert net.load_state_dict(sd).missing_keys == []
    bad = dict(sd, extra=np.zeros(1, np.float32))
    del bad["fc.bias"]
    with pytest.raises(ValueError, match=r"missing keys fc\.bias.*unexpected keys extra"):
        net.load_state_dict(bad)
    result = net.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["fc.bias"] and result.unexpected_keys == ["extra"]
    with pytest.raises(ValueError, match=r"shape mismatch for fc\.weight: checkpoint \(3, 15\)"):
        net.load_state_dict(dict(sd, **{"fc.weight": np.zeros((3, 15), np.float32)}),
                            strict=False)


def test_load_state_dict_copies_into_the_flat_buffer():
    a, b = small_net(seed=0), small_net(seed=1)
    sd = a.state_dict()
    sd["bn.running_mean"] += 1
    b.load_state_dict(sd)
    np.testing.assert_array_equal(b.flat_params, a.flat_params)
    np.testing.assert_array_equal(b.bn.running_mean, a.bn.running_mean + 1)
    assert np.shares_memory(b.fc.weight.data, b.flat_params)
    sd["fc.bias"][:] = 7                        # state_dict hands out copies
    assert not (a.fc.bias.data == 7).any()


def test_hooks_need_flat_buffers():
    with pytest.raises(RuntimeError, match="flatten_parameters"):
        nn.Sequential(nn.Linear(2, 2)).register_grad_ready_hook(print)


def test_bad_input_reaches_a_named_kernel_error():
    conv = nn.Conv2d(3, 4, 3)
    with pytest.raises(TypeError, match="x"):
        conv.forward(np.zeros((1, 3, 5, 5), np.float64))
    with pytest.raises(ValueError, match="w: expects 3 input channels, x has 2"):
        conv.forward(np.zeros((1, 2, 5, 5), np.float32))
