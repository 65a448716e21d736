"""Each convolution's algorithm chosen by timing it on this machine (nn/conv_tuning.py): the
fastest measured is run unless the thresholds' choice is within the noise; the choices are
cached per machine and thread count, logged, kept in the checkpoint (a resumed run runs
what it ran) and, in a job, rank 0's on every rank; `python -m dynar.tune --kernels` fills
the cache ahead of a job."""
import json
import os
import subprocess
import sys

import pytest

from dynar import checkpoint, kernels, models
from dynar.kernels import conv
from dynar.nn import conv_algorithms, conv_tuning
from dynar.train import TrainConfig, train
from mpirun import ROOT, mpi_env, mpiexec


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAR_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "1")
    return tmp_path / "kernels"


def alexnet():
    return models.get("alexnet", num_classes=10, variant="cifar", seed=0)


def test_with_tuning_off_the_thresholds_choose():
    model = alexnet()
    records = conv_tuning.choose(model, 4, 1, tune=False)
    assert [r["layer"] for r in records] == ["features.0", "features.3", "features.6",
                                             "features.8", "features.10"]
    for record, (_, layer, x_shape) in zip(records, conv_tuning.conv_input_shapes(model, 4)):
        assert record["source"] == "rule"
        assert record["choice"] == conv_algorithms.preferred(x_shape, layer.weight.shape,
                                                             layer.stride, layer.padding)


def test_with_known_times_the_fastest_is_chosen_and_a_near_tie_goes_to_the_thresholds(
        cache, monkeypatch):
    # A fake timer: tapgemm fastest on every layer; on the first, the thresholds' own
    # choice only 4% behind it (within the noise margin), so that one is kept.
    model = alexnet()
    rules = {key: conv_tuning.rule(x_shape, layer)
             for _, layer, x_shape in conv_tuning.conv_input_shapes(model, 4)
             for key in [conv_tuning._shape_key(x_shape, layer)]}
    first = next(iter(rules))

    def fake(x_shape, layer, **_):
        key = conv_tuning._shape_key(x_shape, layer)
        seconds = {"gemm": 5.0, "winograd": 4.0, "direct": 6.0, "tapgemm": 1.0}
        if key == first:
            seconds[rules[key]] = 1.04
        return {k: v for k, v in seconds.items()
                if conv_algorithms.ALGORITHMS[k].supports(layer.weight.shape, layer.stride,
                                                          layer.padding)}
    monkeypatch.setattr(conv_tuning, "time_algorithms", fake)
    records = conv_tuning.choose(model, 4, 1)
    assert records[0]["choice"] == rules[first] != "tapgemm"
    assert [r["choice"] for r in records[1:]] == ["tapgemm"] * 4
    assert records[1]["ms"]["tapgemm"] == 1000.0
    conv_tuning.apply(model, records)
    layers = dict(model.named_modules())
    assert [layers[r["layer"]].algorithm for r in records] == [r["choice"] for r in records]


def test_each_layer_gets_the_fastest_measured_and_the_cache_serves_the_next(cache,
                                                                             monkeypatch):
    with kernels.settings_kept():
        kernels.set_num_threads(1)
        first = conv_tuning.choose(alexnet(), 4, 1)
        # The candidates' workspace is given back: the run grows it to its choices' need.
        assert conv.workspace_bytes() == 0
        for record in first:
            ms = record["ms"]
            assert record["source"] == "measured" and set(ms) >= {"gemm", "tapgemm"}
            fastest = min(ms, key=ms.get)
            assert record["choice"] == fastest or \
                ms[record["choice"]] <= ms[fastest] * (1 + conv_tuning.NOISE), record
        (path,) = cache.glob("*.json")
        saved = json.loads(path.read_text())
        assert saved["machine"]["threads"] == 1 and saved["machine"]["cpu"]
        # Cached: nothing is timed again, the same choices come back.
        with monkeypatch.context() as patched:
            patched.setattr(conv_tuning, "time_algorithms",
                            lambda *a, **k: pytest.fail("timed again"))
            again = conv_tuning.choose(alexnet(), 4, 1)
        assert [r["source"] for r in again] == ["cached"] * 5
        assert [r["choice"] for r in again] == [r["choice"] for r in first]
        # Another thread count is another machine for the cache.
        kernels.set_num_threads(2)
        assert {r["source"] for r in conv_tuning.choose(alexnet(), 4, 2)} == {"measured"}
        assert len(list(cache.glob("*.json"))) == 2


def test_a_damaged_cache_is_timed_again_with_a_warning(cache, capsys):
    conv_tuning.choose(models.get("lenet", seed=0), 4, 1)
    (path,) = cache.glob("*.json")
    text = json.loads(path.read_text())
    next(iter(text["layers"].values()))["ms"]["direct"] = float("nan")
    path.write_text(json.dumps(text))
    records = conv_tuning.choose(models.get("lenet", seed=0), 4, 1)
    assert {r["source"] for r in records} == {"measured"}
    assert "unreadable" in capsys.readouterr().err
    path.write_text("{not json")
    assert {r["source"] for r in conv_tuning.choose(models.get("lenet", seed=0), 4, 1)} == \
        {"measured"}
    assert json.loads(path.read_text())["format"] == "dynar-kernel-choices"   # rewritten


def test_an_unknown_setting_of_the_switch_is_an_error(monkeypatch):
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "sometimes")
    with pytest.raises(ValueError, match="DYNAR_KERNEL_TUNE"):
        conv_tuning.enabled()


def test_training_logs_the_choices_and_a_resumed_run_keeps_its_checkpoints(cache, tmp_path,
                                                                         monkeypatch):
    log, folder = tmp_path / "log.jsonl", tmp_path / "ckpt"
    cfg = dict(model="alexnet", variant="cifar", dataset="synthetic", batch_size=8,
               threads=1, eval_every=0, checkpoint_dir=str(folder), sync="buckets")
    train(TrainConfig(**cfg, max_steps=2, log=str(log)))
    (event,) = [json.loads(line) for line in log.read_text().splitlines()
                if '"kernels"' in line]
    assert [r["source"] for r in event["layers"]] == ["measured"] * 5
    chosen = {r["layer"]: r["choice"] for r in event["layers"]}
    assert checkpoint.load(folder / "last.ckpt")["kernels"] == chosen
    # Resumed from a checkpoint that says im2col everywhere: that is what runs.
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "0")
    state = checkpoint.load(folder / "last.ckpt")
    state["kernels"] = {layer: "gemm" for layer in chosen}
    checkpoint.save(folder / "last.ckpt", state)
    result = train(TrainConfig(**cfg, max_steps=3, resume=str(folder), log=str(log)))
    convs = {name: m for name, m in result.model.named_modules() if name in chosen}
    assert {m.algorithm for m in convs.values()} == {"gemm"}
    last = [json.loads(line) for line in log.read_text().splitlines() if '"kernels"' in line]
    assert {r["source"] for r in last[-1]["layers"]} == {"checkpoint"}


def test_tune_kernels_fills_the_cache_training_then_reads(cache):
    env = dict(os.environ, DYNAR_KERNEL_CACHE=str(cache))
    done = subprocess.run([sys.executable, "-m", "dynar.tune", "--kernels", "--model", "lenet",
                           "--batch-size", "8", "--threads", "1"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "conv1" in done.stdout and "measured" in done.stdout
    with kernels.settings_kept():
        kernels.set_num_threads(1)
        records = conv_tuning.choose(models.get("lenet", seed=0), 8, 1)
    assert {r["source"] for r in records} == {"cached"}
    bad = subprocess.run([sys.executable, "-m", "dynar.tune", "--kernels"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "--kernels needs --model" in bad.stderr


RANK_CHOICES = """
import json, sys
from dynar.dist.job import Job
from dynar.train import TrainConfig, Trainer
from dynar.train.config import with_defaults
job = Job.start()
cfg = with_defaults(TrainConfig(model="alexnet", variant="cifar", dataset="synthetic",
                                batch_size=8, threads=1, eval_every=0, sync="buckets"))
trainer = Trainer(cfg, job)
with trainer.dp:
    pass
trainer.close()
print(json.dumps([job.rank, [r["choice"] for r in trainer.kernels]]), flush=True)
"""


@pytest.mark.mpi
def test_every_rank_runs_rank_0s_choices(tmp_path):
    # Rank 1's own cache says im2col everywhere; rank 0's is empty, so it measures; every
    # rank runs what rank 0 measured.
    script, forced, empty = tmp_path / "choices.py", tmp_path / "forced", tmp_path / "empty"
    script.write_text(RANK_CHOICES)
    with kernels.settings_kept():
        kernels.set_num_threads(1)
        os.environ["DYNAR_KERNEL_CACHE"] = str(forced)
        try:
            conv_tuning.choose(alexnet(), 4, 1, tune=True)
        finally:
            del os.environ["DYNAR_KERNEL_CACHE"]
    (path,) = forced.glob("*.json")
    text = json.loads(path.read_text())
    for entry in text["layers"].values():
        entry["choice"] = "gemm"
    path.write_text(json.dumps(text))
    rank = [sys.executable, str(script)]
    cmd = [*mpiexec(), "-n", "1", "env", f"DYNAR_KERNEL_CACHE={empty}", *rank, ":",
           "-n", "1", "env", f"DYNAR_KERNEL_CACHE={forced}", *rank]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=mpi_env({"DYNAR_KERNEL_TUNE": "1"}), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    choices = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert choices[0] == choices[1] != ["gemm"] * 5, choices
    assert list(empty.glob("*.json"))                   # measured on rank 0
