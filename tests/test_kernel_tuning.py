"""Each convolution's algorithm, and each fully connected layer's cut among threads, chosen by
timing them on this machine (nn/kernel_tuning.py): the fastest measured is run unless the
thresholds' (or the default plan's) choice is within the noise; the choices are
cached per machine and thread count, logged, kept in the checkpoint (a resumed run runs
what it ran) and, in a job, rank 0's on every rank; `python -m dynar.tune --kernels` fills
the cache ahead of a job."""
import json
import os
import subprocess
import sys

import pytest

from dynar import checkpoint, kernels, models
from dynar.kernels import conv, linear as linear_kernels
from dynar.kernels.bf16 import cpu_features
from dynar.nn import conv_algorithms, kernel_tuning, precision
from dynar.nn.linear import DEFAULT_PLAN, Linear
from dynar.train import TrainConfig, train
from mpirun import ROOT, mpi_env, mpiexec


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAR_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "1")
    return tmp_path / "kernels"


def alexnet():
    return models.get("alexnet", num_classes=10, variant="cifar", seed=0)


CONVS = ["features.0", "features.3", "features.6", "features.8", "features.10"]
LINEARS = ["classifier.1", "classifier.4", "classifier.6"]


def is_plan(choice):
    return "=" in choice


def test_with_tuning_off_the_thresholds_choose():
    model = alexnet()
    records = kernel_tuning.choose(model, 4, 1, tune=False)
    assert [r["layer"] for r in records] == CONVS + LINEARS
    for record, (_, layer, x_shape) in zip(records, kernel_tuning.tuned_layers(model, 4)):
        assert record["source"] == "rule"
        assert record["choice"] == (DEFAULT_PLAN if isinstance(layer, Linear) else
                                    conv_algorithms.preferred(x_shape, layer.weight.shape,
                                                              layer.stride, layer.padding))


def test_with_known_times_the_fastest_is_chosen_and_a_near_tie_goes_to_the_thresholds(
        cache, monkeypatch):
    # A fake timer: tapgemm fastest on every layer; on the first, the thresholds' own
    # choice only 4% behind it (within the noise margin), so that one is kept.
    model = alexnet()
    rules = {key: kernel_tuning.rule(x_shape, layer)
             for _, layer, x_shape in kernel_tuning.tuned_layers(model, 4)
             if not isinstance(layer, Linear)
             for key in [kernel_tuning._shape_key(x_shape, layer)]}
    first = next(iter(rules))

    def fake(x_shape, layer, **_):
        key = kernel_tuning._shape_key(x_shape, layer)
        seconds = {"gemm": 5.0, "winograd": 4.0, "direct": 6.0, "tapgemm": 1.0}
        if key == first:
            seconds[rules[key]] = 1.04
        return {k: v for k, v in seconds.items()
                if conv_algorithms.ALGORITHMS[k].supports(layer.weight.shape, layer.stride,
                                                          layer.padding)}
    # Fully connected layers: y fastest along the batch in blocks of 16, dw along the input
    # features in blocks of 1024, dx's default cut within the noise of a faster one.
    def fake_cuts(x_shape, layer, **_):
        return {"y=out/64": 2.0, "y=batch/16": 1.0, "y=out/256": 1.5,
                "dx=in/64": 1.03, "dx=batch/16": 1.0,
                "dw=out/64": 2.0, "dw=in/1024": 1.0, "dw=out/1024": 1.2}
    monkeypatch.setattr(kernel_tuning, "time_algorithms", fake)
    monkeypatch.setattr(kernel_tuning, "time_cuts", fake_cuts)
    records = kernel_tuning.choose(model, 4, 1)
    assert records[0]["choice"] == rules[first] != "tapgemm"
    assert [r["choice"] for r in records[1:5]] == ["tapgemm"] * 4
    assert records[1]["ms"]["tapgemm"] == 1000.0
    assert [r["choice"] for r in records[5:]] == ["y=batch/16 dx=in/64 dw=in/1024"] * 3
    kernel_tuning.apply(model, records)
    layers = dict(model.named_modules())
    assert [layers[r["layer"]].algorithm for r in records[:5]] == \
        [r["choice"] for r in records[:5]]
    assert [layers[r["layer"]].plan for r in records[5:]] == [r["choice"] for r in records[5:]]


def test_each_layer_gets_the_fastest_measured_and_the_cache_serves_the_next(cache,
                                                                             monkeypatch):
    with kernels.settings_kept():
        kernels.set_num_threads(1)
        first = kernel_tuning.choose(alexnet(), 4, 1)
        # The candidates' workspace is given back: the run grows it to its choices' need.
        assert conv.workspace_bytes() == 0 and linear_kernels.workspace_bytes() == 0
        for record in first:
            ms = record["ms"]
            assert record["source"] == "measured"
            if is_plan(record["choice"]):
                # Each product's cut: its fastest, or the default within the noise of it.
                for cut in record["choice"].split():
                    product = cut.partition("=")[0]
                    times = {k: v for k, v in ms.items() if k.startswith(product + "=")}
                    assert len(times) >= 2 and cut in times, (cut, times)
                    assert times[cut] <= min(times.values()) * (1 + kernel_tuning.NOISE)
                continue
            assert set(ms) >= {"gemm", "tapgemm"}
            fastest = min(ms, key=ms.get)
            assert record["choice"] == fastest or \
                ms[record["choice"]] <= ms[fastest] * (1 + kernel_tuning.NOISE), record
        (path,) = cache.glob("*.json")
        saved = json.loads(path.read_text())
        assert saved["machine"]["threads"] == 1 and saved["machine"]["cpu"]
        # Cached: nothing is timed again, the same choices come back.
        with monkeypatch.context() as patched:
            patched.setattr(kernel_tuning, "time_algorithms",
                            lambda *a, **k: pytest.fail("timed again"))
            again = kernel_tuning.choose(alexnet(), 4, 1)
        assert [r["source"] for r in again] == ["cached"] * 8
        assert [r["choice"] for r in again] == [r["choice"] for r in first]
        # Another thread count is another machine for the cache.
        kernels.set_num_threads(2)
        assert {r["source"] for r in kernel_tuning.choose(alexnet(), 4, 2)} == {"measured"}
        assert len(list(cache.glob("*.json"))) == 2


class _ScriptedClock:
    """perf_counter for kernel_tuning: each fake kernel's forward advances it by the next of
    its scripted durations (the last repeats)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def kernel(self, durations, fp32=None):
        """A kernel taking `durations` (and `fp32` on float32 calls, when given)."""
        clock, left = self, {True: list(durations), False: list(fp32 or durations)}

        class Scripted:
            def supports(self, *_):
                return True

            def forward(self, *_, bf16=True, **__):
                times = left[bool(bf16) or fp32 is None]
                clock.now += times.pop(0) if len(times) > 1 else times[0]

            def backward(self, *_, **__):
                pass
        return Scripted()


@pytest.mark.parametrize("prior_times, expected", [
    # A burst of load through the prior's first 4 calls: the rematch in turns finds it
    # faster, so it stays.
    ([10.0] * 4 + [5.0], "prior"),
    # The other really is faster: the rematch confirms it.
    ([10.0], "other"),
])
def test_a_lead_over_the_thresholds_choice_is_rematched_in_turns(monkeypatch, prior_times,
                                                                  expected):
    clock = _ScriptedClock()
    monkeypatch.setattr(kernel_tuning, "time", clock)
    monkeypatch.setattr(conv_algorithms, "ALGORITHMS",
                        {"prior": clock.kernel(prior_times), "other": clock.kernel([8.0])})
    layer = alexnet().features[3]
    seconds = kernel_tuning.time_algorithms((2, 64, 8, 8), layer, repeats=3, first="prior")
    assert kernel_tuning._fastest(seconds, "prior") == expected
    assert seconds["other"] == 8.0
    assert seconds["prior"] == min(prior_times)


def test_a_bf16_layer_is_timed_apart_on_its_bf16_kernels(cache, monkeypatch):
    """A layer in bf16 runs other kernels than in fp32: its shapes are cached apart and timed
    with bf16 calls, as the layer makes them."""
    calls = []

    def fake(x_shape, layer, first=None):
        calls.append(layer.precision)
        return {"gemm": 1.0, "tapgemm": 2.0}
    monkeypatch.setattr(kernel_tuning, "time_algorithms", fake)
    monkeypatch.setattr(kernel_tuning, "time_cuts", lambda *a, **k: {DEFAULT_PLAN: 1.0})
    fp32 = kernel_tuning.choose(alexnet(), 4, 1)
    bf16_model = precision.set_precision(alexnet(), "bf16")
    bf16 = kernel_tuning.choose(bf16_model, 4, 1)
    assert {r["source"] for r in bf16 if r["kind"] == "conv"} == {"measured"}
    assert calls == ["fp32"] * 5 + ["bf16"] * 5
    assert all(a["shape"] + " bf16" == b["shape"] for a, b in zip(fp32, bf16)
               if a["kind"] == "conv")
    # The real timing (the fakes undone) hands the kernels bf16 calls, and float32 ones
    # only to the "/fp32" candidates of a CPU with bf16 convolution kernels.
    monkeypatch.undo()
    seen = []
    monkeypatch.setitem(conv_algorithms.ALGORITHMS, "gemm",
                        _Recording(conv_algorithms.ALGORITHMS["gemm"], seen))
    timed = kernel_tuning.time_algorithms((2, 3, 32, 32), bf16_model.features[0], repeats=1)
    in_fp32 = conv.bf16_kernels()
    assert set(seen) == ({True, False} if in_fp32 else {True})
    assert ("gemm/fp32" in timed) == in_fp32


@pytest.mark.parametrize("has_bf16_kernels", [True, False])
def test_a_bf16_layer_computes_in_float32_where_that_is_faster(cache, monkeypatch,
                                                               has_bf16_kernels):
    """On the per-tap GEMMs of a 2x2 plane bf16 ran slower than float32 (a Zen 4): where a
    CPU's bf16 kernels lose to float32 on a layer, that layer computes in float32. Without
    bf16 kernels (the portable path, kept for its numerics) float32 does not compete."""
    clock = _ScriptedClock()
    monkeypatch.setattr(kernel_tuning, "time", clock)
    monkeypatch.setattr(conv, "bf16_kernels", lambda: has_bf16_kernels)
    monkeypatch.setattr(conv_algorithms, "ALGORITHMS",
                        {"tapgemm": clock.kernel([2.0], fp32=[1.0]),
                         "winograd": clock.kernel([1.5], fp32=[3.0]),
                         "direct": clock.kernel([5.0], fp32=[0.5])})
    # Each rounding pass of the portable path (the layer's own, nn/precision.py: x and w
    # going forward, dy, x and w coming back) takes a quarter.
    rounding = precision.round_to_bf16

    def timed_rounding(out, a):
        clock.now += 0.25
        return rounding(out, a)
    monkeypatch.setattr(precision, "round_to_bf16", timed_rounding)
    layer = alexnet().features[3]
    layer.precision = "bf16"
    seconds = kernel_tuning.time_algorithms((2, 64, 8, 8), layer, repeats=1, first="winograd")
    if not has_bf16_kernels:
        assert seconds == {"winograd": 2.75, "tapgemm": 3.25, "direct": 6.25}
        return
    # Direct has no bf16 kernel: it is timed once, as the layer would run it, rounding.
    assert seconds == {"winograd": 1.5, "tapgemm": 2.0, "direct": 6.25,
                       "winograd/fp32": 3.0, "tapgemm/fp32": 1.0}
    choice = kernel_tuning._fastest(seconds, "winograd")
    assert choice == "tapgemm/fp32"
    # A near tie keeps bf16, the precision asked for (and the thresholds' choice within it);
    # between float32's, the thresholds' algorithm.
    assert kernel_tuning._fastest({**seconds, "tapgemm/fp32": 1.45}, "winograd") == "winograd"
    assert kernel_tuning._fastest({"tapgemm": 1.0, "winograd": 1.02, "winograd/fp32": 0.99},
                                  "winograd") == "winograd"
    assert kernel_tuning._fastest({"winograd": 1.3, "winograd/fp32": 1.0, "tapgemm/fp32": 0.99},
                                  "winograd") == "winograd/fp32"
    model = precision.set_precision(alexnet(), "bf16")
    kernel_tuning.apply(model, [{"layer": "features.3", "choice": choice}])
    assert (model.features[3].algorithm, model.features[3].precision) == ("tapgemm", "fp32")
    assert model.features[6].precision == "bf16"


def test_a_float32_choice_is_cached_and_a_bad_one_refused(cache, monkeypatch, capsys):
    monkeypatch.setattr(kernel_tuning, "time_algorithms",
                        lambda *a, **k: {"tapgemm": 2.0, "tapgemm/fp32": 1.0})
    monkeypatch.setattr(kernel_tuning, "time_cuts", lambda *a, **k: {"y=out/64": 1.0})
    bf16_model = lambda: precision.set_precision(alexnet(), "bf16")      # noqa: E731
    first = kernel_tuning.choose(bf16_model(), 4, 1)
    assert {r["choice"] for r in first if r["kind"] == "conv"} == {"tapgemm/fp32"}
    again = kernel_tuning.choose(bf16_model(), 4, 1)
    assert {r["source"] for r in again} == {"cached"}
    (path,) = cache.glob("*.json")
    text = json.loads(path.read_text())
    next(e for k, e in text["layers"].items() if not k.startswith("linear"))["choice"] = \
        "tapgemm/fp16"
    path.write_text(json.dumps(text))
    assert {r["source"] for r in kernel_tuning.choose(bf16_model(), 4, 1)} == {"measured"}
    assert "unreadable" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tapgemm/fp16"):
        kernel_tuning.split_choice("tapgemm/fp16")


class _Recording:
    """An algorithm that notes the bf16 argument of its calls."""
    def __init__(self, algorithm, seen):
        self.algorithm, self.seen = algorithm, seen

    def supports(self, *args):
        return self.algorithm.supports(*args)

    def forward(self, *args, bf16=False):
        self.seen.append(bf16)
        self.algorithm.forward(*args, bf16=bf16)

    def backward(self, *args, bf16=False):
        self.seen.append(bf16)
        self.algorithm.backward(*args, bf16=bf16)


def test_a_damaged_cache_is_timed_again_with_a_warning(cache, capsys):
    kernel_tuning.choose(models.get("lenet", seed=0), 4, 1)
    (path,) = cache.glob("*.json")
    text = json.loads(path.read_text())
    next(iter(text["layers"].values()))["ms"]["direct"] = float("nan")
    path.write_text(json.dumps(text))
    records = kernel_tuning.choose(models.get("lenet", seed=0), 4, 1)
    assert {r["source"] for r in records} == {"measured"}
    assert "unreadable" in capsys.readouterr().err
    path.write_text("{not json")
    assert {r["source"] for r in kernel_tuning.choose(models.get("lenet", seed=0), 4, 1)} == \
        {"measured"}
    assert json.loads(path.read_text())["format"] == "dynar-kernel-choices"   # rewritten
    text = json.loads(path.read_text())
    (fc1,) = [entry for key, entry in text["layers"].items() if key.startswith("linear x=4x400")]
    fc1["choice"] = "y=sideways/64 dx=in/64 dw=out/64"
    path.write_text(json.dumps(text))
    assert {r["source"] for r in kernel_tuning.choose(models.get("lenet", seed=0), 4, 1)} == \
        {"measured"}
    assert "unreadable" in capsys.readouterr().err


def test_an_unknown_setting_of_the_switch_is_an_error(monkeypatch):
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "sometimes")
    with pytest.raises(ValueError, match="DYNAR_KERNEL_TUNE"):
        kernel_tuning.enabled()


def test_training_logs_the_choices_and_a_resumed_run_keeps_its_checkpoints(cache, tmp_path,
                                                                         monkeypatch):
    log, folder = tmp_path / "log.jsonl", tmp_path / "ckpt"
    cfg = dict(model="alexnet", variant="cifar", dataset="synthetic", batch_size=8,
               threads=1, eval_every=0, checkpoint_dir=str(folder), sync="buckets")
    train(TrainConfig(**cfg, max_steps=2, log=str(log)))
    (event,) = [json.loads(line) for line in log.read_text().splitlines()
                if '"kernels"' in line]
    assert [r["source"] for r in event["layers"]] == ["measured"] * 8
    assert [r["kind"] for r in event["layers"]] == ["conv"] * 5 + ["linear"] * 3
    chosen = {r["layer"]: r["choice"] for r in event["layers"]}
    assert checkpoint.load(folder / "last.ckpt")["kernels"] == chosen
    # Resumed from a checkpoint that says im2col and a batch cut everywhere: that is what
    # runs.
    monkeypatch.setenv("DYNAR_KERNEL_TUNE", "0")
    state = checkpoint.load(folder / "last.ckpt")
    forced = "y=batch/16 dx=batch/16 dw=in/16"
    state["kernels"] = {layer: forced if is_plan(c) else "gemm" for layer, c in chosen.items()}
    checkpoint.save(folder / "last.ckpt", state)
    result = train(TrainConfig(**cfg, max_steps=3, resume=str(folder), log=str(log)))
    layers = dict(result.model.named_modules())
    assert {layers[name].algorithm for name in CONVS} == {"gemm"}
    assert {layers[name].plan for name in LINEARS} == {forced}
    last = [json.loads(line) for line in log.read_text().splitlines() if '"kernels"' in line]
    assert {r["source"] for r in last[-1]["layers"]} == {"checkpoint"}
    assert [r["kind"] for r in last[-1]["layers"]] == ["conv"] * 5 + ["linear"] * 3


def test_tune_kernels_fills_the_cache_training_then_reads(cache):
    env = dict(os.environ, DYNAR_KERNEL_CACHE=str(cache))
    done = subprocess.run([sys.executable, "-m", "dynar.tune", "--kernels", "--model", "lenet",
                           "--batch-size", "8", "--threads", "1"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "conv1" in done.stdout and "measured" in done.stdout
    with kernels.settings_kept():
        kernels.set_num_threads(1)
        records = kernel_tuning.choose(models.get("lenet", seed=0), 8, 1)
    assert {r["source"] for r in records} == {"cached"}
    # A bf16 job's layers are other entries; they are timed in bf16 where the CPU has it.
    bf16 = subprocess.run([sys.executable, "-m", "dynar.tune", "--kernels", "--model", "lenet",
                           "--batch-size", "8", "--threads", "1", "--precision", "bf16"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert bf16.returncode == 0, bf16.stderr
    assert ("measured" in bf16.stdout) == bool(cpu_features()), bf16.stdout
    assert "bf16 instructions" in bf16.stdout if cpu_features() else "running fp32" in bf16.stdout
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
            kernel_tuning.choose(alexnet(), 4, 1, tune=True)
        finally:
            del os.environ["DYNAR_KERNEL_CACHE"]
    (path,) = forced.glob("*.json")
    text = json.loads(path.read_text())
    forced_choices = []
    for key, entry in text["layers"].items():
        entry["choice"] = "y=batch/16 dx=batch/16 dw=in/16" if key.startswith("linear") else \
            "gemm"
        forced_choices.append(entry["choice"])
    path.write_text(json.dumps(text))
    rank = [sys.executable, str(script)]
    cmd = [*mpiexec(), "-n", "1", "env", f"DYNAR_KERNEL_CACHE={empty}", *rank, ":",
           "-n", "1", "env", f"DYNAR_KERNEL_CACHE={forced}", *rank]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=mpi_env({"DYNAR_KERNEL_TUNE": "1"}), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    choices = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert choices[0] == choices[1] and sorted(choices[1]) != sorted(forced_choices), choices
    assert list(empty.glob("*.json"))                   # measured on rank 0
