"""bf16 mixed precision (issue 25's targets): training throughput and peak memory of dynar
in bf16 against dynar in fp32 and PyTorch in fp32 and under bf16 autocast, and the bf16 loss
curve against the fp32 one.

Throughput follows perf/models.py's protocol: each of the four runs in its own process, the
four alternating round by round, medians after warm-up. The loss curves are two
`python -m dynar.train` runs of resnet18-cifar on synthetic data, same seed, 300 steps:
the target is the bf16 run's final loss within 2% of the fp32 run's.

The speed targets are for CPUs with AVX512_BF16, AMX or aarch64 BF16. On a CPU without,
dynar's bf16 column is its portable path (the rounding's cost over fp32), and PyTorch's
autocast is not run: its bf16 convolutions fall back to reference loops there, tens of
times slower than its fp32 (docs/notes/2026-12-05-bf16-numerics.md), a peer no user would
pick. The loss curve holds anywhere.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from . import harness
from .models import ROOT, _measure

MODELS = [("resnet18", "cifar", 64), ("vgg16_bn", "cifar", 64), ("resnet50", "imagenet", 32)]
RUNS = [("dynar", "fp32"), ("dynar", "bf16"), ("torch", "fp32"), ("torch", "bf16")]
CURVE = dict(model="resnet18", variant="cifar", batch=64, steps=300)
# The final loss of a curve: the mean of its last steps' (one step's loss is noisy).
FINAL_STEPS = 20
TARGET_LOSS_GAP = 0.02


def _throughput(quick, threads, runs):
    rounds = 1 if quick else 3
    records = []
    for name, variant, batch in MODELS:
        steps = 2 if quick else (4 if variant == "imagenet" else 6)
        samples = {run: [] for run in runs}
        rss = {run: 0.0 for run in runs}
        for _ in range(rounds):
            for framework, precision in runs:
                result = _measure(framework, name, variant, batch, threads, steps,
                                  precision=precision)
                samples[(framework, precision)] += result["times"]
                rss[(framework, precision)] = max(rss[(framework, precision)],
                                                  result["max_rss_mb"])
        rate = {run: batch / statistics.median(s) for run, s in samples.items()}
        records.append({"model": f"{name}-{variant}", "batch": batch, "threads": threads,
                        "samples": {f"{f} {p}": s for (f, p), s in samples.items()},
                        "images_per_sec": {f"{f} {p}": r for (f, p), r in rate.items()},
                        "max_rss_mb": {f"{f} {p}": m for (f, p), m in rss.items()}})
    return records


def _loss_curve(precision, steps, threads):
    """The per-step losses of one training run (a fresh process, as a user runs it)."""
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "log.jsonl")
        cmd = [sys.executable, "-m", "dynar.train", "--model", CURVE["model"], "--variant",
               CURVE["variant"], "--dataset", "synthetic", "--batch-size", str(CURVE["batch"]),
               "--max-steps", str(steps), "--seed", "0", "--eval-every", "0",
               "--threads", str(threads), "--precision", precision, "--log", log]
        # The numerics are the same on any CPU; where it has no bf16 instructions this
        # runs the portable path rather than falling back to fp32.
        env = dict(os.environ, DYNAR_BF16_ANY_CPU="1")
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=7200, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"{precision} loss curve failed: {out.stderr.strip()[-2000:]}")
        with open(log) as f:
            records = [json.loads(line) for line in f]
    ran = records[-1]["precision"]
    if ran != precision:
        raise RuntimeError(f"the {precision} loss curve ran in {ran}")
    return [r["loss"] for r in records if r["event"] == "step"]


def run(quick=False):
    from dynar import kernels
    from dynar.kernels.bf16 import cpu_features
    threads = kernels.get_num_threads()
    features = cpu_features()
    runs = RUNS if features else [run for run in RUNS if run != ("torch", "bf16")]
    records = _throughput(quick, threads, runs)
    rows = []
    for rec in records:
        rate, rss = rec["images_per_sec"], rec["max_rss_mb"]
        torch_bf16 = rate.get("torch bf16")
        rows.append([rec["model"], str(rec["batch"])]
                    + [f"{rate[f'{f} {p}']:,.1f}" if f"{f} {p}" in rate else "not run"
                       for f, p in RUNS]
                    + [f"{rate['dynar bf16'] / rate['dynar fp32']:.2f}x",
                       f"{rate['dynar bf16'] / torch_bf16:.2f}x" if torch_bf16 else "-"]
                    + [f"{rss[f'{f} {p}']:.0f}" for f, p in RUNS[:2]])
    table = harness.format_table(
        ["model", "batch", "dynar fp32 img/s", "dynar bf16 img/s", "PyTorch fp32 img/s",
         "PyTorch bf16 autocast img/s", "dynar bf16 / fp32", "dynar bf16 / PyTorch bf16",
         "dynar fp32 max RSS MB", "dynar bf16 max RSS MB"], rows)
    found = ", ".join(features) or ("none: dynar bf16 is its portable path, PyTorch bf16 "
                                    "autocast not run (reference loops)")
    table += (f"\n\n{threads} threads, synthetic data, SGD momentum 0.9; medians of "
              f"{1 if quick else 3} rounds of the processes alternating. bf16 instructions "
              f"on this CPU: {found}")

    steps = 30 if quick else CURVE["steps"]
    curves = {p: _loss_curve(p, steps, threads) for p in ("fp32", "bf16")}
    final = {p: statistics.fmean(c[-FINAL_STEPS:]) for p, c in curves.items()}
    gap = abs(final["bf16"] - final["fp32"]) / final["fp32"]
    table += (f"\n\nLoss curve, {CURVE['model']}-{CURVE['variant']} on synthetic data, batch "
              f"{CURVE['batch']}, {steps} steps, seed 0: final loss (mean of the last "
              f"{FINAL_STEPS} steps) fp32 {final['fp32']:.4f}, bf16 {final['bf16']:.4f}, "
              f"{100 * gap:.2f}% apart (target <= {100 * TARGET_LOSS_GAP:.0f}%)")
    print(table)
    path = harness.write_result("bf16", {"models": records, "bf16_instructions": list(features),
                                         "loss_curves": curves, "final_loss": final,
                                         "loss_gap": gap, "table": table})
    print(f"wrote {path}")
    return records
