"""Single-process training throughput and peak memory: dynar against PyTorch.

Protocol (docs/DESIGN.md, "Benchmark protocol"): batch 64 (32 at ImageNet size), synthetic N(0,1) inputs, SGD
momentum 0.9, threads = cores for both, median step time after 3 warm-up steps. Each
framework runs in its own process (so max RSS is its own), and the processes alternate
dynar, torch, dynar, torch, ...; the torch models are the ones the parity tests check dynar
against (tests/torch_reference.py).
"""
import json
import os
import statistics
import subprocess
import sys

from . import harness
from .kernels import ALGORITHMS

# (model, variant, batch)
MODELS = [("lenet", "mnist", 64), ("alexnet", "cifar", 64), ("vgg16_bn", "cifar", 64),
          ("resnet18", "cifar", 64), ("alexnet", "imagenet", 32), ("vgg16", "imagenet", 32),
          ("resnet50", "imagenet", 32)]
WARMUP = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dynar_step_fn(name, variant, threads, x, y, timed=None, precision="fp32"):
    """One training step of dynar's model in `precision` (nn/precision.py: bf16 runs on any
    CPU here). With `timed` (a dict), every leaf layer's forward and backward, the loss and
    the optimizer add their seconds to timed[kind]."""
    from dynar import kernels, models, nn, optim
    from dynar.nn import kernel_tuning, precision as precisions
    kernels.set_num_threads(threads)
    kernels.set_flush_denormals(True)
    kw = {"dropout": 0.0} if name.startswith(("alexnet", "vgg")) else {}
    model = models.get(name, variant=variant, seed=0, **kw)
    # As training chooses (timed, cached; DYNAR_KERNEL_TUNE=0: the thresholds), in the
    # precision the layers run.
    precisions.set_precision(model, precision)
    kernel_tuning.apply(model, kernel_tuning.choose(model, len(y), threads))
    crit = nn.CrossEntropyLoss()
    opt = optim.SGD(model, lr=0.01, momentum=0.9)
    if timed is not None:
        for module in [m for m in model.modules() if not list(m.children())] + [crit, opt]:
            _time_calls(module, timed, precision)

    def step():
        model.zero_grad(lazy=True)
        crit.forward(model.forward(x), y)
        model.backward(crit.backward())
        opt.step()
    return step


def _layer_kind(module, precision):
    """The breakdown's name for `module`'s calls; a layer that computes in another precision
    than the run's (tuning's "/fp32" choices) says so."""
    kind = type(module).__name__
    if kind == "Conv2d":
        kind = f"Conv2d {ALGORITHMS[module.kernel]}"
    own = getattr(module, "precision", precision)
    return kind if own == precision else f"{kind} {own}"


def _time_calls(obj, timed, precision):
    import time
    for method in ("forward", "backward", "step"):
        inner = getattr(obj, method, None)
        if inner is None:
            continue

        def wrapper(*args, inner=inner, method=method):
            start = time.perf_counter()
            out = inner(*args)
            key = f"{_layer_kind(obj, precision)} {method}"
            timed[key] = timed.get(key, 0.0) + time.perf_counter() - start
            return out
        setattr(obj, method, wrapper)


def _torch_step_fn(name, variant, threads, x, y, precision="fp32"):
    """One training step of the PyTorch twin; in bf16 under torch.autocast, as a PyTorch
    user trains in mixed precision on a CPU."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch_reference
    torch.set_num_threads(threads)
    model = torch_reference.build(name, variant)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = crit(model(xt), yt)
        loss.backward()
        opt.step()
    return step


def worker(framework, name, variant, batch, threads, steps, precision="fp32"):
    """Run in a fresh process: warm up, time `steps` training steps, report with max RSS."""
    import resource
    import time

    import numpy as np
    rng = np.random.default_rng(0)
    shape = {"mnist": (1, 28, 28), "cifar": (3, 32, 32), "imagenet": (3, 224, 224)}[variant]
    x = rng.standard_normal((batch,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    make = _dynar_step_fn if framework == "dynar" else _torch_step_fn
    step = make(name, variant, threads, x, y, precision=precision)
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "max_rss_mb": _peak_rss_mb()}))


def _peak_rss_mb():
    """This process's own peak RSS. Not getrusage's ru_maxrss: Linux carries the forked
    parent's resident size across exec into it, so a worker started by a big harness process
    (python -m perf all, after the kernels suite) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def breakdown_worker(name, variant, batch, threads, steps, precision="fp32"):
    """Run in a fresh process: seconds per step by layer kind and pass, after warm-up."""
    import numpy as np
    rng = np.random.default_rng(0)
    from dynar import models
    shape = models.get(name, variant=variant, seed=0).input_shape
    x = rng.standard_normal((batch,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, batch)
    timed = {}
    step = _dynar_step_fn(name, variant, threads, x, y, timed, precision)
    for _ in range(WARMUP):
        step()
    timed.clear()
    import time
    start = time.perf_counter()
    for _ in range(steps):
        step()
    total = (time.perf_counter() - start) / steps
    print(json.dumps({"step_s": total, "by_kind": {k: v / steps for k, v in timed.items()}}))


def _breakdown_table(breakdowns):
    """Share of the step per layer kind and pass, one column per model."""
    kinds = sorted({k for b in breakdowns.values() for k in b["by_kind"]},
                   key=lambda k: -max(b["by_kind"].get(k, 0) / b["step_s"]
                                      for b in breakdowns.values()))
    rows = []
    for kind in kinds:
        rows.append([kind] + [f"{100 * b['by_kind'][kind] / b['step_s']:.1f}%"
                              if kind in b["by_kind"] else "-" for b in breakdowns.values()])
    rows.append(["not in a layer (model, Python)"] + [
        f"{100 * (1 - sum(b['by_kind'].values()) / b['step_s']):.1f}%"
        for b in breakdowns.values()])
    rows.append(["step ms"] + [f"{1e3 * b['step_s']:.1f}" for b in breakdowns.values()])
    return harness.format_table(["layer, pass"] + list(breakdowns), rows)


def _steps(name, variant, quick):
    if name == "lenet":
        return 20 if quick else 60
    return 2 if variant == "imagenet" and quick else 3 if quick else 6


def _measure(framework, name, variant, batch, threads, steps, mode="--worker",
             precision="fp32"):
    cmd = [sys.executable, "-m", "perf.models", mode, framework, name, variant, str(batch),
           str(threads), str(steps), precision]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if out.returncode != 0:
        raise RuntimeError(f"{framework} {name} worker failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick=False):
    from dynar import kernels
    threads = kernels.get_num_threads()
    rounds = 1 if quick else 3
    rows, records = [], []
    for name, variant, batch in MODELS:
        steps = _steps(name, variant, quick)
        samples = {"dynar": [], "torch": []}
        rss = {"dynar": 0.0, "torch": 0.0}
        for _ in range(rounds):
            for framework in ("dynar", "torch"):
                result = _measure(framework, name, variant, batch, threads, steps)
                samples[framework] += result["times"]
                rss[framework] = max(rss[framework], result["max_rss_mb"])
        med = {f: statistics.median(s) for f, s in samples.items()}
        rec = {"model": f"{name}-{variant}", "batch": batch, "threads": threads,
               "samples": samples, "max_rss_mb": rss,
               "dynar_images_per_sec": batch / med["dynar"],
               "torch_images_per_sec": batch / med["torch"],
               "speedup": med["torch"] / med["dynar"],
               "rss_ratio": rss["dynar"] / rss["torch"]}
        records.append(rec)
        rows.append([rec["model"], str(batch), f"{rec['dynar_images_per_sec']:,.0f}",
                     f"{rec['torch_images_per_sec']:,.0f}", f"{rec['speedup']:.2f}x",
                     f"{rss['dynar']:.0f}", f"{rss['torch']:.0f}"])
    table = harness.format_table(["model", "batch", "dynar img/s", "PyTorch img/s", "dynar / PyTorch",
                                  "dynar max RSS MB", "PyTorch max RSS MB"], rows)
    table += (f"\n\n{threads} threads, synthetic data, SGD momentum 0.9; convolutions as "
              f"training chooses them (DYNAR_KERNEL_TUNE="
              f"{os.environ.get('DYNAR_KERNEL_TUNE', '1')}); medians of {rounds} alternating "
              f"process pairs")
    # Where dynar's step goes: every layer timed (the timers cost a few microseconds a call).
    breakdowns = {f"{name}-{variant}": _measure("dynar", name, variant, batch, threads,
                                                 _steps(name, variant, quick),
                                                 mode="--breakdown")
                  for name, variant, batch in MODELS}
    table += ("\n\nWhere dynar's step goes (share of the step time, per layer kind and "
              "pass):\n\n" + _breakdown_table(breakdowns))
    print(table)
    path = harness.write_result("models", {"models": records, "breakdown": breakdowns,
                                           "table": table})
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8]), sys.argv[8])
    elif len(sys.argv) == 9 and sys.argv[1] == "--breakdown":
        breakdown_worker(sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8]), sys.argv[8])
    else:
        raise SystemExit("usage: python -m perf models (this module's __main__ is the worker)")
