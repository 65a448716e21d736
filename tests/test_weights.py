"""Weights in and out of PyTorch: the .safetensors format (written and read by dynar, checked
against the `safetensors` package), state_dicts PyTorch saved going into --init-from and
--eval-only, and dynar.export's files loading with strict=True into PyTorch, each with the
same logits; a file that does not fit is refused listing its bad keys.

"The torchvision model of the same name" is tests/torch_reference.py's restatement of it in
plain torch with torchvision's names (torchvision is not a test dependency); the CIFAR
variants' definition is the one docs/PYTORCH.md gives, run here against that stand-in."""
import json
import os
import re
import struct
import subprocess
import sys
import types

import numpy as np
import pytest
from support import require_torch

from dynar import data, models, safetensors_format, weights
from dynar.train import TrainConfig, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELATIVE = 1e-4      # the bound on the logits


def _python(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# -- the .safetensors format ------------------------------------------------------------------

def _all_dtypes(rng):
    return {"f32": rng.standard_normal((3, 4)).astype(np.float32),
            "f64": rng.standard_normal(5), "f16": rng.standard_normal(2).astype(np.float16),
            "i64 scalar": np.array(7, np.int64), "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
            "u8": np.arange(4, dtype=np.uint8), "bool": np.array([True, False]),
            "empty": np.zeros((0, 3), np.float32), "i8": np.array([-1, 2], np.int8)}


def test_safetensors_round_trip_keeps_names_order_dtypes_shapes_and_metadata(tmp_path, rng):
    tensors = _all_dtypes(rng)
    path = tmp_path / "w.safetensors"
    with open(path, "wb") as f:
        safetensors_format.write(f, tensors, {"model": "resnet18"})
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0   # data aligned
    back, meta = safetensors_format.read(path)
    assert list(back) == list(tensors) and meta == {"model": "resnet18"}
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        np.testing.assert_array_equal(back[name], value)


def test_safetensors_files_are_interchangeable_with_the_safetensors_package(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy", reason="pip install safetensors")
    tensors = _all_dtypes(rng)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with open(ours, "wb") as f:
        safetensors_format.write(f, tensors, {"k": "v"})
    for name, value in st.load_file(str(ours)).items():
        np.testing.assert_array_equal(value, tensors[name])
    st.save_file(tensors, str(theirs), metadata={"k": "v"})
    back, meta = safetensors_format.read(theirs)
    assert meta == {"k": "v"} and back.keys() == tensors.keys()
    for name, value in back.items():
        np.testing.assert_array_equal(value, tensors[name])


def _header_file(tmp_path, header, data=b"", length=None):
    text = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize("header, data, length, needle", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None,
     "cover 8 bytes but the file holds 4"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 1 << 40,
     "header length"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     "needs 12"),
    ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     "dtype 'X9'"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None,
     "gap or overlap"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
     "not a list of sizes"),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "exactly dtype, shape"),
    ({"__metadata__": {"n": 1}}, b"", None, "__metadata__ must map names to strings"),
])
def test_a_broken_safetensors_file_is_refused_naming_the_rule(tmp_path, header, data, length,
                                                              needle):
    path = _header_file(tmp_path, header, data, length)
    with pytest.raises(safetensors_format.SafetensorsError, match=re.escape(needle)):
        safetensors_format.read(path)


def test_safetensors_garbage_and_short_files_are_refused(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(safetensors_format.SafetensorsError, match="shorter than"):
        safetensors_format.read(short)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"\xff{[x")
    with pytest.raises(safetensors_format.SafetensorsError, match="not UTF-8 JSON"):
        safetensors_format.read(garbage)


# -- state_dict files -------------------------------------------------------------------------

def test_state_dict_files_by_extension_and_the_wrappers_training_scripts_save(tmp_path, rng):
    torch = require_torch()
    state = {"fc.weight": rng.standard_normal((3, 2)).astype(np.float32),
             "fc.bias": np.zeros(3, np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
    for ext in (".safetensors", ".npz", ".pth"):
        path = tmp_path / f"w{ext}"
        weights.write_state_dict(path, state)
        back = weights.read_state_dict(path)
        assert back.keys() == state.keys(), ext
        for k in state:
            np.testing.assert_array_equal(back[k], state[k])
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    torch.save({"model": {f"module.{k}": v for k, v in tensors.items()}, "epoch": 3},
               tmp_path / "wrapped.pth")
    assert weights.read_state_dict(tmp_path / "wrapped.pth").keys() == state.keys()
    torch.save({"fc.weight": tensors["fc.weight"].bfloat16()}, tmp_path / "bf16.pth")
    assert weights.read_state_dict(tmp_path / "bf16.pth")["fc.weight"].dtype == np.float32
    with pytest.raises(weights.WeightsError, match="holds no state_dict"):
        torch.save([1, 2], tmp_path / "list.pth")
        weights.read_state_dict(tmp_path / "list.pth")
    with pytest.raises(weights.WeightsError, match="unknown weights format '.bin'"):
        weights.read_state_dict(tmp_path / "w.bin")


def test_pth_without_torch_is_refused_with_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)       # `import torch` raises ImportError
    with pytest.raises(weights.WeightsError, match=r"a \.pth file needs PyTorch.*\.safetensors"):
        weights.write_state_dict(tmp_path / "w.pth", {"a": np.zeros(1, np.float32)})
    (tmp_path / "x.pth").write_bytes(b"anything")
    with pytest.raises(weights.WeightsError, match=r"reading a \.pth file needs PyTorch"):
        weights.read_state_dict(tmp_path / "x.pth")
    assert not [p for p in os.listdir(tmp_path) if p != "x.pth"]    # nothing half-written


# -- PyTorch -> --init-from -> --eval-only ----------------------------------------------------

def _images(tmp_path, rng, shape=(3, 32, 32), classes=10, count=12):
    path = tmp_path / "images.npz"
    np.savez(path, x=rng.random((count,) + shape, np.float32),
             y=rng.integers(0, classes, count), x_test=rng.random((count,) + shape, np.float32),
             y_test=rng.integers(0, classes, count))
    ds = data.load("npz", data_dir=str(path), num_classes=classes)
    (x, y), = data.Loader(ds, count, split="test").batches(0)
    return path, x.copy(), y.copy()


def _torch_model_with_statistics(torch, name, variant, seed=0):
    """A torchvision-named PyTorch model with random weights and BatchNorm statistics of its
    own (not the initial 0 and 1), in eval mode."""
    import torch_reference
    torch.manual_seed(seed)
    net = torch_reference.build(name, variant)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.num_batches_tracked.fill_(12)
    return net.eval()


def _close(ours, theirs):
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, rtol=RELATIVE, atol=RELATIVE * scale)


@pytest.mark.slow
def test_a_pytorch_state_dict_evaluates_in_dynar_with_the_same_logits(tmp_path, rng, capsys):
    # In process: the command line's flags reach TrainConfig in the tests below.
    torch = require_torch()
    torch.set_num_threads(2)
    images, x, y = _images(tmp_path, rng)
    net = _torch_model_with_statistics(torch, "resnet18", "cifar")
    path = tmp_path / "resnet18.pth"
    torch.save(net.state_dict(), path)
    with torch.no_grad():
        logits = net(torch.from_numpy(x)).numpy()
    loss = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)).item()
    top = torch.from_numpy(logits).topk(5, dim=1).indices.numpy()
    top1, top5 = (top[:, 0] == y).mean(), (top == y[:, None]).any(axis=1).mean()
    log = tmp_path / "log.jsonl"
    ours = train(TrainConfig(model="resnet18", variant="cifar", dataset="npz",
                             data_dir=str(images), init_from=str(path), eval_only=True,
                             batch_size=8, log=str(log),
                             checkpoint_dir=str(tmp_path / "run"))).model.eval()
    _close(ours.forward(x), logits)
    printed = capsys.readouterr().out
    assert f"top-1 {100 * top1:.2f}%, top-5 {100 * top5:.2f}% ({len(y)} images)" in printed
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["eval_only"] and summary["steps"] == 0
    np.testing.assert_allclose(summary["final_loss"], loss, rtol=RELATIVE)
    assert (summary["final_accuracy"], summary["final_top5"]) == (top1, top5)
    assert sorted(os.listdir(tmp_path)) == ["images.npz", "log.jsonl", "resnet18.pth"]


def test_init_from_lists_the_keys_that_do_not_fit_and_new_head_fine_tunes(tmp_path, rng):
    torch = require_torch()
    vgg = tmp_path / "vgg.pth"
    torch.save(_torch_model_with_statistics(torch, "vgg11_bn", "cifar").state_dict(), vgg)
    images, _, _ = _images(tmp_path, rng, count=4)          # cheaper than synthetic's
    out = _python("-m", "dynar.train", "--model", "resnet18", "--variant", "cifar",
                  "--dataset", "npz", "--data-dir", str(images), "--num-classes", "10",
                  "--batch-size", "4",
                  "--init-from", str(vgg), "--eval-only")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    line, = [l for l in out.stderr.splitlines() if l.strip()]
    assert f"{vgg}: does not fit resnet18 (cifar variant, 10 classes)" in line
    assert "missing keys conv1.weight, bn1.weight" in line and "... and" in line
    assert "unexpected keys features.0.weight, features.0.bias" in line
    # Another class count: the classifier's shapes are named, with the way to fine-tune.
    hundred = models.get("resnet18", num_classes=100, variant="cifar", seed=1)
    path = tmp_path / "r100.safetensors"
    weights.write_state_dict(path, hundred.state_dict())
    model = models.get("resnet18", num_classes=10, variant="cifar", seed=2)
    with pytest.raises(weights.WeightsError,
                       match=r"shape mismatch for fc\.weight: checkpoint \(100, 512\), model "
                             r"\(10, 512\).*--init-from-head new"):
        weights.load_weights(model, path)
    fresh = model.state_dict()
    weights.load_weights(model, path, new_head=True)
    got = model.state_dict()
    np.testing.assert_array_equal(got["fc.weight"], fresh["fc.weight"])     # kept fresh
    np.testing.assert_array_equal(got["layer4.1.bn2.running_var"],
                                  hundred.state_dict()["layer4.1.bn2.running_var"])
    assert train(TrainConfig(model="resnet18", variant="cifar", dataset="npz",
                             data_dir=str(images), num_classes=10, batch_size=4, max_steps=1,
                             eval_every=0, init_from=str(path),
                             init_from_head="new")).summary["steps"] == 1


@pytest.mark.parametrize("args, needle", [
    (["--eval-only"], "--eval-only: give the weights"),
    (["--init-from", "a.npz", "--resume", "b"], "--init-from and --resume"),
    (["--init-from-head", "new"], "--init-from-head new: needs --init-from"),
    (["--init-from", "/nonexistent-dynar/w.safetensors"], "no such file"),
    (["--init-from", "w.onnx"], "unknown weights format '.onnx'"),
    (["--eval-only", "--resume", "auto", "--checkpoint-dir", "/nonexistent-dynar/run"],
     "name the checkpoint to evaluate"),
])
def test_init_from_and_eval_only_errors_are_one_line(args, needle):
    out = _python("-m", "dynar.train", "--dataset", "synthetic", *args, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr


# -- dynar.export -> PyTorch ------------------------------------------------------------------

def _docs_definition():
    """The code block of docs/PYTORCH.md that defines dynar_model(), as source."""
    text = open(os.path.join(ROOT, "docs", "PYTORCH.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    block, = [b for b in blocks if "def dynar_model(" in b]
    return block


def _torchvision_stand_in():
    """A `torchvision` module whose models are tests/torch_reference.py's (torchvision's
    architectures and names, restated in plain torch)."""
    import torch_reference
    names = ["alexnet", "resnet18", "resnet34", "resnet50"] + [
        f"{v}{bn}" for v in torch_reference.VGG_CONFIGS for bn in ("", "_bn")]
    stand_in = types.ModuleType("torchvision")
    stand_in.models = types.SimpleNamespace(**{
        name: (lambda name: lambda num_classes=1000: torch_reference.build(
            name, "imagenet", num_classes))(name) for name in names})
    return stand_in


def _dynar_model_in_pytorch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", _torchvision_stand_in())
    namespace = {}
    exec(_docs_definition(), namespace)
    return namespace["dynar_model"]


@pytest.mark.parametrize("name, variant, shape, ext", [
    ("vgg11_bn", "cifar", (3, 32, 32), ".safetensors"),
    pytest.param("resnet18", "cifar", (3, 32, 32), ".pth", marks=pytest.mark.slow),
    ("alexnet", "cifar", (3, 32, 32), ".safetensors"), ("lenet", "mnist", (1, 28, 28), ".pth"),
    pytest.param("resnet18", "imagenet", (3, 224, 224), ".safetensors",
                 marks=pytest.mark.slow)])
def test_export_loads_strictly_into_pytorch_with_the_same_logits(tmp_path, monkeypatch, rng,
                                                                 name, variant, shape, ext):
    torch = require_torch()
    torch.set_num_threads(2)
    dynar_model = _dynar_model_in_pytorch(monkeypatch)
    batch = 2
    images, _, _ = _images(tmp_path, rng, shape, count=batch)     # cheaper than synthetic's
    result = train(TrainConfig(model=name, variant=variant, dataset="npz", data_dir=str(images),
                               num_classes=10, max_steps=1, batch_size=batch, eval_every=0,
                               dropout=0.0 if name == "alexnet" else None,
                               checkpoint_dir=str(tmp_path / "run")))
    out = tmp_path / f"{name}{ext}"
    done = _python("-m", "dynar.export", str(tmp_path / "run"), str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: {name} ({variant} variant, 10 classes)")
    net = dynar_model(name, variant, num_classes=10)
    state = torch.load(out) if ext == ".pth" else {
        k: torch.from_numpy(v) for k, v in safetensors_format.read(out)[0].items()}
    net.load_state_dict(state, strict=True)
    x = rng.standard_normal((batch,) + tuple(result.model.input_shape)).astype(np.float32)
    with torch.no_grad():
        theirs = net.eval()(torch.from_numpy(x)).numpy()
    _close(result.model.eval().forward(x), theirs)


def test_export_errors_are_one_line_and_write_nothing(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    for args, needle in (([str(bad), str(tmp_path / "o.safetensors")], "corrupt or truncated"),
                         ([str(tmp_path / "none"), str(tmp_path / "o.npz")], "no such"),
                         ([str(bad), str(tmp_path / "o.onnx")], "corrupt")):
        out = _python("-m", "dynar.export", *args, timeout=60)
        assert out.returncode == 1 and needle in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["bad.ckpt"]


def test_eval_only_from_a_checkpoint_computes_each_layer_as_its_run_did(tmp_path, monkeypatch):
    # A bf16 run whose tuning kept conv2 in float32 (written into the checkpoint here, as
    # kernel tuning would): evaluating it must not run that layer in bf16.
    from dynar import checkpoint
    from dynar.nn import kernel_tuning
    monkeypatch.setenv("DYNAR_BF16_ANY_CPU", "1")
    short = dict(model="lenet", dataset="synthetic", eval_every=0, precision="bf16")
    train(TrainConfig(max_steps=1, batch_size=16, checkpoint_dir=str(tmp_path), **short))
    path = os.path.realpath(tmp_path / "last.ckpt")
    state = checkpoint.load(path)
    assert state["kernels"]["conv2"] != "gemm/fp32"
    state["kernels"]["conv2"] = "gemm/fp32"
    checkpoint.save(path, state)
    result = train(TrainConfig(resume=str(tmp_path), eval_only=True, **short))
    layers = dict(result.model.named_modules())
    assert (layers["conv2"].algorithm, layers["conv2"].precision) == ("gemm", "fp32")
    algorithm, in_fp32 = kernel_tuning.split_choice(state["kernels"]["conv1"])
    assert (layers["conv1"].algorithm, layers["conv1"].precision) == (algorithm, in_fp32 or "bf16")


def test_eval_only_from_a_checkpoint_takes_its_model_alone(tmp_path):
    from dynar import checkpoint, nn
    short = dict(model="lenet", dataset="synthetic", eval_every=0)
    train(TrainConfig(max_steps=2, batch_size=16, checkpoint_dir=str(tmp_path), **short))
    written = sorted(os.listdir(tmp_path))
    # Another batch size, schedule and momentum: refused by a resume, taken for evaluating.
    done = train(TrainConfig(resume=str(tmp_path), eval_only=True, batch_size=100,
                             momentum=0.0, schedule="cosine", **short)).summary
    model = models.get("lenet")
    model.load_state_dict(checkpoint.load(tmp_path / "last.ckpt")["model"])
    ds = data.load("synthetic", model_input_shape=(1, 28, 28), num_classes=10)
    (x, y), = data.Loader(ds, len(ds.y_test), split="test").batches(0)
    model.eval()
    assert done["steps"] == 0 and done["eval_only"]
    np.testing.assert_allclose(done["final_loss"], nn.CrossEntropyLoss().forward(
        model.forward(x), y), rtol=1e-6)
    assert sorted(os.listdir(tmp_path)) == written and "last.ckpt" in written   # nothing new
    with pytest.raises(checkpoint.CheckpointError, match="saved with --model 'lenet'"):
        train(TrainConfig(resume=str(tmp_path), eval_only=True,
                          **dict(short, model="alexnet", variant="cifar")))
