"""The training recipe's options, each against PyTorch's own implementation of it: label
smoothing (nn.CrossEntropyLoss), gradient clipping by global norm
(torch.nn.utils.clip_grad_norm_), no weight decay on BatchNorm and bias parameters (SGD
parameter groups), gradient accumulation (gradients summed over micro-batches), top-5
accuracy (torch.topk); and --log-every, --config FILE.toml."""
import numpy as np
import pytest
from support import require_torch

from dynar import models, nn, optim
from dynar.train.metrics import top_k_correct


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_label_smoothing_matches_torch(smoothing, scale, rng):
    torch = require_torch()
    logits = (3 * rng.standard_normal((16, 10))).astype(np.float32)
    labels = rng.integers(0, 10, 16)
    crit = nn.CrossEntropyLoss(label_smoothing=smoothing)
    loss = crit.forward(logits, labels)
    dlogits = crit.backward(scale)
    lt = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)(lt, torch.tensor(labels))
    (ref * scale).backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_label_smoothing_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        nn.CrossEntropyLoss(label_smoothing=1.5)


def _small_bn_net(seed=0):
    g = np.random.default_rng(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, generator=g), nn.BatchNorm2d(3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5, generator=g)
                         ).flatten_parameters()


def _torch_params(torch, model):
    return {n: torch.nn.Parameter(torch.from_numpy(p.data.copy()))
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_clip_grad_norm_matches_torch(max_norm, rng):
    torch = require_torch()
    model = _small_bn_net()
    model.flat_grads[:] = rng.standard_normal(model.flat_grads.size).astype(np.float32)
    params = _torch_params(torch, model)
    for n, p in model.named_parameters():
        params[n].grad = torch.from_numpy(p.grad.copy())
    norm = optim.clip_grad_norm_(model, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    np.testing.assert_allclose(norm, ref.item(), rtol=1e-5)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, params[n].grad.numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=n)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        optim.clip_grad_norm_(model, 0.0)


def test_no_weight_decay_groups_match_torch_param_groups(rng):
    torch = require_torch()
    from dynar.train import TrainConfig
    from dynar.train.build import build_optimizer
    model = _small_bn_net()
    cfg = TrainConfig(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True,
                      no_wd_bn_bias=True)
    opt = build_optimizer(cfg, model)
    params = _torch_params(torch, model)
    # torchvision's recipe: no decay on normalization layers' parameters and on biases.
    exempt = {"1.weight", "1.bias", "0.bias", "4.bias"}
    topt = torch.optim.SGD([{"params": [p for n, p in params.items() if n not in exempt]},
                            {"params": [p for n, p in params.items() if n in exempt],
                             "weight_decay": 0.0}],
                           lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)
    for step in range(4):
        model.flat_grads[:] = rng.standard_normal(model.flat_grads.size).astype(np.float32)
        for n, p in model.named_parameters():
            params[n].grad = torch.from_numpy(p.grad.copy())
        opt.step()
        topt.step()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.data, params[n].detach().numpy(), rtol=1e-6,
                                       atol=1e-7, err_msg=f"{n} after step {step}")
    decayed = build_optimizer(TrainConfig(lr=0.05, weight_decay=1e-2, momentum=0.0), model)
    assert [d for _, _, d in decayed._runs] == [None]        # one run, the optimizer's decay


def test_sgd_groups_may_set_weight_decay_only():
    model = _small_bn_net()
    with pytest.raises(ValueError, match="may set weight_decay only, got lr"):
        optim.SGD([{"params": model.parameters(), "lr": 0.1}], lr=0.1)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        optim.SGD([{"params": model.parameters(), "weight_decay": -1.0}], lr=0.1)


def test_top_k_correct_matches_torch_topk(rng):
    torch = require_torch()
    logits = rng.standard_normal((200, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 200)
    top = torch.tensor(logits).topk(5, dim=1).indices.numpy()
    for k in (1, 5):
        assert top_k_correct(logits, labels, k) == int((top[:, :k] == labels[:, None]).any(1).sum())
    assert top_k_correct(logits, labels, 10) == 200
    logits[3] = np.nan                                     # a broken row is never correct
    assert top_k_correct(logits, labels, 10) == 199


def test_accumulated_micro_batches_are_the_big_batch_and_pytorchs_accumulation(tmp_path):
    # LeNet (no BatchNorm, no dropout): 4 micro-batches of 4 give the batch of 16 up to
    # summation order, and PyTorch's own accumulation (loss / 4 backward per micro-batch).
    torch = require_torch()
    from dynar import data
    from dynar.train import TrainConfig, train
    kw = dict(model="lenet", dataset="synthetic", batch_size=16, max_steps=3, lr=0.05,
              momentum=0.9, weight_decay=1e-3, eval_every=0, seed=5)
    whole = train(TrainConfig(**kw)).model.state_dict()
    parts = train(TrainConfig(accumulate=4, **kw)).model.state_dict()
    import torch_reference
    net = torch_reference.lenet()
    net.load_state_dict({k: torch.from_numpy(v)
                         for k, v in models.get("lenet", seed=5).state_dict().items()})
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ds = data.load("synthetic", seed=5, model_input_shape=(1, 28, 28), num_classes=10)
    crit = torch.nn.CrossEntropyLoss()
    for _, (x, y) in zip(range(3), data.Loader(ds, 16, seed=5).batches(0)):
        opt.zero_grad()
        for k in range(4):
            part = slice(4 * k, 4 * k + 4)
            (crit(net(torch.from_numpy(x[part].copy())), torch.from_numpy(y[part].copy()))
             / 4).backward()
        opt.step()
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(parts[name], whole[name], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(parts[name], value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def _images(tmp_path, rng, shape, count, test_count):
    """An .npz dataset of random images, 10 classes: cheaper to open than synthetic's 4096."""
    path = tmp_path / "images.npz"
    np.savez(path, x=rng.random((count,) + shape, np.float32), y=rng.integers(0, 10, count),
             x_test=rng.random((test_count,) + shape, np.float32),
             y_test=rng.integers(0, 10, test_count))
    return path


def test_a_training_run_with_the_recipe_is_pytorchs_training_with_it(tmp_path, rng, capsys):
    # LeNet for one epoch of 2 steps with label smoothing, clipping that acts and no decay on
    # biases, against PyTorch's loop with the same three; the logged norms are torch's, the
    # epoch record's top-5 is torch.topk's on the final weights, and --log-every 1 prints
    # both steps off a terminal.
    torch = require_torch()
    import json

    import torch_reference
    from dynar import data
    from dynar.train import TrainConfig, train
    path = _images(tmp_path, rng, (1, 28, 28), 32, 20)
    log = tmp_path / "log.jsonl"
    kw = dict(model="lenet", dataset="npz", data_dir=str(path), augment=False, epochs=1,
              batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-2, schedule="constant",
              warmup_epochs=0, seed=5)
    ours = train(TrainConfig(label_smoothing=0.2, clip_grad_norm=0.05, no_wd_bn_bias=True,
                             log=str(log), log_every=1, **kw)).model.state_dict()
    progress = [line.split()[3] for line in capsys.readouterr().out.splitlines()
                if line.startswith("epoch 1 step")]
    net = torch_reference.lenet()
    net.load_state_dict({k: torch.from_numpy(v)
                         for k, v in models.get("lenet", seed=5).state_dict().items()})
    params = dict(net.named_parameters())
    opt = torch.optim.SGD([{"params": [p for n, p in params.items() if n.endswith("weight")]},
                           {"params": [p for n, p in params.items() if n.endswith("bias")],
                            "weight_decay": 0.0}], lr=0.05, momentum=0.9, weight_decay=1e-2)
    crit, norms = torch.nn.CrossEntropyLoss(label_smoothing=0.2), []
    ds = data.load("npz", data_dir=str(path))
    for x, y in data.Loader(ds, 16, augment=False, seed=5).batches(0):
        opt.zero_grad()
        crit(net(torch.from_numpy(x.copy())), torch.from_numpy(y.copy())).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item())
        opt.step()
    assert len(norms) == 2 and min(norms) > 0.05                 # clipping acted
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    (x, y), = data.Loader(ds, 20, split="test").batches(0)
    with torch.no_grad():
        top = net(torch.from_numpy(x.copy())).topk(5, dim=1).indices.numpy()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    epoch, = [r for r in records if r["event"] == "epoch"]
    np.testing.assert_allclose([r["grad_norm"] for r in records if r["event"] == "step"],
                               norms, rtol=1e-4)
    assert progress == ["1/2", "2/2"]
    assert epoch["eval_top5"] == (top == y[:, None]).any(axis=1).mean()
    assert epoch["eval_accuracy"] == (top[:, 0] == y).mean()


@pytest.mark.parametrize("replica", ["on", "off"])
def test_clipping_and_micro_batches_across_ranks_give_every_rank_one_norm(replica):
    # A BatchNorm net on 2 ranks, 2 micro-batches, clipped every step: the same norm on every
    # rank (with a node replica each rank holds its own parts of the averaged gradient),
    # replicas identical, and one rank training the same micro-batches alone agrees.
    from mpirun import run_mpi
    done = run_mpi(2, ["tests/mpi/recipe_check.py", "4", "16", "2", "0.5"], timeout=120,
                   env={"DYNAR_NODE_REPLICA": replica})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" ok, node replica") == 2, done.stdout


def test_log_every_prints_a_line_every_n_steps_off_a_terminal():
    import io
    from dynar.train.report import Reporter
    out = io.StringIO()
    report = Reporter(stream=out, total_steps=10, steps_per_epoch=100, log_every=3)
    for step in range(1, 11):
        report.step(0, step, 1.0, 0.1, {"step": 0.01, "data": 0, "compute": 0,
                                         "comm_exposed": 0, "update": 0, "batch_stats": 0})
    assert [line.split()[3] for line in out.getvalue().splitlines()] == \
        ["3/10", "6/10", "9/10"]


def _settings(tmp_path, text, *argv):
    from dynar.train.cli import config_from_args, parse_args
    path = tmp_path / "run.toml"
    path.write_text(text)
    return config_from_args(parse_args(["--config", str(path), *argv]))


def test_config_file_sets_any_flag_and_the_command_line_overrides_it(tmp_path):
    cfg = _settings(tmp_path, 'model = "resnet18"\nvariant = "cifar"\nlr = 0.2\n'
                    'milestones = [3, 6]\nno-wd-bn-bias = true\nlabel_smoothing = 0.1\n'
                    'batchnorm = "local"\n', "--lr", "0.05")
    assert (cfg.model, cfg.variant, cfg.lr, cfg.milestones) == ("resnet18", "cifar", 0.05, [3, 6])
    assert cfg.no_wd_bn_bias and cfg.label_smoothing == 0.1 and cfg.batchnorm == "local"


@pytest.mark.parametrize("text, needle", [
    ("lrr = 0.1\n", "'lrr' is not a setting"),
    ("lr = -1\n", "--config {}: argument --lr: must be > 0"),
    ("nesterov = 1\n", "nesterov: expected true or false"),
    ("lr = [0.1]\n", "lr: expected one value"),
    ("config = 'x.toml'\n", "'config' is not a setting"),
    ("lr = 0.1\nlr = 0.2\n", "not valid TOML"),
])
def test_a_bad_config_file_is_one_line_naming_the_file(tmp_path, capsys, text, needle):
    with pytest.raises(SystemExit):
        _settings(tmp_path, text)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle.format(tmp_path / "run.toml") in err, err


def test_the_effective_configuration_is_logged(tmp_path):
    import json
    import subprocess
    import sys
    (tmp_path / "run.toml").write_text("max_steps = 2\nbatch_size = 8\nlabel_smoothing = 0.2\n")
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "-m", "dynar.train", "--config",
                          str(tmp_path / "run.toml"), "--dataset", "synthetic", "--eval-every",
                          "0", "--log", str(log), "--batch-size", "4"], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    first = json.loads(log.read_text().splitlines()[0])
    assert first["event"] == "config" and first["config"] == str(tmp_path / "run.toml")
    assert (first["max_steps"], first["batch_size"], first["label_smoothing"]) == (2, 4, 0.2)
    assert (first["model"], first["lr"], first["epochs"]) == ("lenet", 0.01, 20)   # defaults
    assert "settings: model=lenet" in out.stdout and "label_smoothing=0.2" in out.stdout


@pytest.mark.parametrize("change, flag", [
    (dict(label_smoothing=0.1), "--label-smoothing 0.0"),
    (dict(clip_grad_norm=1.0), "--clip-grad-norm None"),
    (dict(accumulate=2), "--accumulate 1"),
    (dict(no_wd_bn_bias=True), "--no-wd-bn-bias False"),
])
def test_resume_refuses_another_recipe(tmp_path, change, flag):
    from dynar import checkpoint
    from dynar.train import TrainConfig, train
    short = dict(model="lenet", dataset="synthetic", batch_size=8, max_steps=1, eval_every=0)
    train(TrainConfig(checkpoint_dir=str(tmp_path), **short))
    with pytest.raises(checkpoint.CheckpointError, match=f"saved with {flag},"):
        train(TrainConfig(resume=str(tmp_path), **dict(short, **change)))


def test_the_batchnorm_mode_is_in_the_start_line_and_resume_refuses_another(tmp_path, rng,
                                                                            capsys):
    from dynar import checkpoint
    from dynar.train import TrainConfig, train
    short = dict(model="vgg11_bn", variant="cifar", dataset="npz", batch_size=2, max_steps=1,
                 data_dir=str(_images(tmp_path, rng, (3, 32, 32), 4, 2)), num_classes=10,
                 eval_every=0, batchnorm="local")
    train(TrainConfig(checkpoint_dir=str(tmp_path), **short))
    assert "batchnorm local" in capsys.readouterr().out
    with pytest.raises(checkpoint.CheckpointError, match="saved with --batchnorm 'local',"):
        train(TrainConfig(resume=str(tmp_path), **dict(short, batchnorm="global")))
