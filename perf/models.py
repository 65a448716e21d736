"""Single-process training throughput and peak memory: dynar against PyTorch.

Protocol (DESIGN.md): batch 64, synthetic N(0,1) inputs, SGD momentum 0.9, threads = cores
for both, median step time after 3 warm-up steps. Each framework runs in its own process
(so max RSS is its own), and the processes alternate dynar, torch, dynar, torch, ...; the
torch models are the ones the parity tests check dynar against (tests/torch_reference.py).
"""
import json
import os
import statistics
import subprocess
import sys

from . import harness

MODELS = [("lenet", "mnist"), ("alexnet", "cifar"), ("vgg16_bn", "cifar"), ("resnet18", "cifar")]
BATCH = 64
WARMUP = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dynar_step_fn(name, variant, threads, x, y):
    from dynar import kernels, models, nn, optim
    kernels.set_num_threads(threads)
    kernels.set_flush_denormals(True)
    kw = {"dropout": 0.0} if name.startswith(("alexnet", "vgg")) else {}
    model = models.get(name, variant=variant, seed=0, **kw)
    crit = nn.CrossEntropyLoss()
    opt = optim.SGD(model, lr=0.01, momentum=0.9)

    def step():
        model.zero_grad()
        crit.forward(model.forward(x), y)
        model.backward(crit.backward())
        opt.step()
    return step


def _torch_step_fn(name, variant, threads, x, y):
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
        crit(model(xt), yt).backward()
        opt.step()
    return step


def worker(framework, name, variant, threads, steps):
    """Run in a fresh process: warm up, time `steps` training steps, report with max RSS."""
    import resource
    import time

    import numpy as np
    rng = np.random.default_rng(0)
    shape = {"mnist": (1, 28, 28), "cifar": (3, 32, 32), "imagenet": (3, 224, 224)}[variant]
    x = rng.standard_normal((BATCH,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, BATCH).astype(np.int64)
    make = _dynar_step_fn if framework == "dynar" else _torch_step_fn
    step = make(name, variant, threads, x, y)
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


def _measure(framework, name, variant, threads, steps):
    cmd = [sys.executable, "-m", "perf.models", "--worker", framework, name, variant,
           str(threads), str(steps)]
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
    for name, variant in MODELS:
        steps = (20 if name == "lenet" else 3) if quick else (60 if name == "lenet" else 6)
        samples = {"dynar": [], "torch": []}
        rss = {"dynar": 0.0, "torch": 0.0}
        for _ in range(rounds):
            for framework in ("dynar", "torch"):
                result = _measure(framework, name, variant, threads, steps)
                samples[framework] += result["times"]
                rss[framework] = max(rss[framework], result["max_rss_mb"])
        med = {f: statistics.median(s) for f, s in samples.items()}
        rec = {"model": f"{name}-{variant}", "batch": BATCH, "threads": threads,
               "samples": samples, "max_rss_mb": rss,
               "dynar_images_per_sec": BATCH / med["dynar"],
               "torch_images_per_sec": BATCH / med["torch"],
               "speedup": med["torch"] / med["dynar"],
               "rss_ratio": rss["dynar"] / rss["torch"]}
        records.append(rec)
        rows.append([rec["model"], f"{rec['dynar_images_per_sec']:,.0f}",
                     f"{rec['torch_images_per_sec']:,.0f}", f"{rec['speedup']:.2f}x",
                     f"{rss['dynar']:.0f}", f"{rss['torch']:.0f}"])
    table = harness.format_table(["model", "dynar img/s", "PyTorch img/s", "dynar / PyTorch",
                                  "dynar max RSS MB", "PyTorch max RSS MB"], rows)
    print(table)
    print(f"\nbatch {BATCH}, {threads} threads, synthetic data, SGD momentum 0.9; medians of "
          f"{rounds} alternating process pairs")
    path = harness.write_result("models", {"models": records, "table": table})
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit("usage: python -m perf models (this module's __main__ is the worker)")
