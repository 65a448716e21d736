"""dynar.optim: SGD against torch.optim.SGD over several steps (every hyper-parameter
combination), resuming from state_dict, contiguous-run fusion; learning-rate schedules
against torch.optim.lr_scheduler."""
import numpy as np
import pytest
from support import require_torch

from dynar import nn, optim


def net(seed=0):
    g = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(6, 5, generator=g), nn.ReLU(),
                         nn.Linear(5, 3, generator=g)).flatten_parameters()


def fake_grads(model, step):
    model.flat_grads[:] = np.random.default_rng(100 + step).standard_normal(
        model.flat_grads.size).astype(np.float32)


@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=5e-4),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.8, dampening=0.3),
])
def test_sgd_matches_torch(kw):
    torch = require_torch()
    model = net()
    params = {n: torch.nn.Parameter(torch.from_numpy(p.data.copy()))
              for n, p in model.named_parameters()}
    topt = torch.optim.SGD(list(params.values()), **kw)
    opt = optim.SGD(model.parameters(), **kw)
    for step in range(5):
        fake_grads(model, step)
        for n, p in model.named_parameters():
            params[n].grad = torch.from_numpy(p.grad.copy())
        opt.step()
        topt.step()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.data, params[n].detach().numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{n} after step {step}")


def test_sgd_is_one_fused_run_over_a_model():
    model = net()
    opt = optim.SGD(model, lr=0.1, momentum=0.9)
    assert len(opt._runs) == 1
    params, grads, _ = opt._runs[0]
    assert np.shares_memory(params, model.flat_params) and params.size == model.flat_params.size
    assert opt.momentum_buffer.shape == model.flat_params.shape
    assert optim.SGD(model, lr=0.1).momentum_buffer is None     # no buffer without momentum


def test_sgd_on_some_parameters_updates_only_those():
    model = net()
    before = model.flat_params.copy()
    opt = optim.SGD([model[2].weight, model[0].bias], lr=1.0)
    assert len(opt._runs) == 2                   # not adjacent in the flat buffer
    model.flat_grads[:] = 1
    opt.step()
    changed = model.flat_params != before
    assert changed.sum() == model[2].weight.size + model[0].bias.size
    assert (model[0].weight.data == before[-model[0].weight.size - 5:-5].reshape(5, 6)).all()


def test_sgds_updating_parts_of_one_velocity_equal_one_sgd():
    # Ranks of a node sharing one replica: each updates its parts, all keep one velocity.
    whole, split = net(), net()
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    ref = optim.SGD(whole, **kw)
    n = split.flat_params.size
    velocity = np.zeros(n, np.float32)
    ranks = [optim.SGD(split, **kw) for _ in range(3)]
    for opt in ranks:
        opt.relocate(momentum_buffer=velocity)
    parts = [[(0, 7), (n // 2, n - 3)], [(7, 7), (7, n // 2)], [(n - 3, n)]]  # one empty
    for step in range(4):
        fake_grads(whole, step)
        fake_grads(split, step)
        ref.step()
        # A new plan hands the ranks other parts: each optimizer follows its new ranges.
        mine = parts[step % 3:] + parts[:step % 3]
        before = split.flat_params.copy()
        ranks[1].step(mine[1])                # one rank alone touches its parts only
        inside = np.zeros(n, bool)
        for lo, hi in mine[1]:
            inside[lo:hi] = True
        changed = split.flat_params != before
        assert changed.any() and not (changed & ~inside).any()
        ranks[0].step(mine[0])
        ranks[2].step(mine[2])
        np.testing.assert_array_equal(split.flat_params, whole.flat_params)
        np.testing.assert_array_equal(velocity, ref.momentum_buffer)
    assert ranks[0].state_dict()["momentum_buffer"].shape == (n,)


def test_sgd_rejects_a_bad_range_or_velocity_storage():
    model = net()
    n = model.flat_params.size
    with pytest.raises(ValueError, match=rf"range \(0, {n + 1}\) is not within the {n} parameters"):
        optim.SGD(model, lr=0.1).step([(0, n + 1)])
    with pytest.raises(ValueError, match=rf"relocate: .*shape \({n},\)"):
        optim.SGD(model, lr=0.1, momentum=0.9).relocate(np.zeros(n - 1, np.float32))
    with pytest.raises(ValueError, match="no momentum"):
        optim.SGD(model, lr=0.1).relocate(np.zeros(n, np.float32))


def test_sgd_state_dict_resumes_exactly():
    a, b = net(), net()
    opt_a = optim.SGD(a, lr=0.1, momentum=0.9, weight_decay=1e-4)
    for step in range(3):
        fake_grads(a, step)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = optim.SGD(b, lr=0.5)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt_b.load_state_dict(opt_a.state_dict())   # momentum off here, on there
    opt_b = optim.SGD(b, lr=0.5, momentum=0.1)
    opt_b.load_state_dict(opt_a.state_dict())
    assert (opt_b.lr, opt_b.momentum, opt_b.steps) == (0.1, 0.9, 3)
    for step in range(3, 6):
        fake_grads(a, step)
        fake_grads(b, step)
        opt_a.step()
        opt_b.step()
    np.testing.assert_array_equal(a.flat_params, b.flat_params)


def test_sgd_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD(net(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(net(), lr=-1)
    with pytest.raises(ValueError, match="flatten_parameters"):
        optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


class _Opt:
    lr = 0.1


def _torch_lrs(torch, make, steps):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = make(torch.optim.lr_scheduler, opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _dynar_lrs(make, steps):
    opt = _Opt()
    sched = make(opt)
    lrs = [opt.lr]
    for _ in range(steps):
        sched.step()
        lrs.append(opt.lr)
    assert sched.get_last_lr() == [opt.lr]
    return lrs


@pytest.mark.parametrize("ours,theirs", [
    (lambda o: optim.StepLR(o, 3, gamma=0.5), lambda s, o: s.StepLR(o, 3, gamma=0.5)),
    (lambda o: optim.MultiStepLR(o, [7, 2, 5], gamma=0.3),
     lambda s, o: s.MultiStepLR(o, [7, 2, 5], gamma=0.3)),
    (lambda o: optim.CosineAnnealingLR(o, 10, eta_min=0.001),
     lambda s, o: s.CosineAnnealingLR(o, 10, eta_min=0.001)),
    (lambda o: optim.LinearWarmup(optim.CosineAnnealingLR(o, 12), 4, start_factor=0.1),
     lambda s, o: s.ChainedScheduler([s.LinearLR(o, 0.1, 1.0, 4), s.CosineAnnealingLR(o, 12)])),
    (lambda o: optim.LinearWarmup(optim.MultiStepLR(o, [3, 8]), 5),
     lambda s, o: s.ChainedScheduler([s.LinearLR(o, 1 / 3, 1.0, 5), s.MultiStepLR(o, [3, 8])])),
])
def test_schedules_match_torch(ours, theirs):
    torch = require_torch()
    steps = 25       # past T_max and the last milestone
    np.testing.assert_allclose(_dynar_lrs(ours, steps), _torch_lrs(torch, theirs, steps),
                               rtol=1e-9, atol=1e-12)


def test_schedule_state_dict_resumes():
    def make(o):
        return optim.LinearWarmup(optim.StepLR(o, 4, gamma=0.5), 3)
    full = _dynar_lrs(make, 10)
    a = _Opt()
    sched = make(a)
    for _ in range(6):
        sched.step()
    b = _Opt()
    resumed = make(b)
    resumed.load_state_dict(sched.state_dict())
    assert b.lr == full[6]
    lrs = []
    for _ in range(4):
        resumed.step()
        lrs.append(b.lr)
    assert lrs == full[7:]
