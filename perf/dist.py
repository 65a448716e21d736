"""Data-parallel training on this machine: dynar's sync modes against PyTorch DDP (gloo).

Protocol (issue 4): 2 ranks x 1 compute thread (mpiexec --bind-to none), global batch 64 (32 per rank), synthetic data,
SGD momentum 0.9. Scaling efficiency = 2-rank img/s / (2 x img/s of 1 rank x 1 thread at
batch 32), each framework against its own 1-rank baseline, all measured in one run,
alternating frameworks round by round; medians over the measured steps.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from . import harness
from .models import ROOT, WARMUP

MODELS = [("lenet", "mnist"), ("alexnet", "cifar")]
MODES = ["per-layer", "fused", "buckets"]
RANKS, PER_RANK = 2, 32


def _mpiexec(ranks):
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = exe if os.path.exists(exe) else "mpiexec"
    # Unbound: DDP's gloo and dynar's communication thread each run a helper thread beside
    # the compute thread; binding a rank to one core would make them share it.
    return [exe, "--oversubscribe", "--bind-to", "none", "-n", str(ranks)]


def _env():
    # Threads are set by each framework's own flag (--threads 1, torch.set_num_threads(1)),
    # as a user would, not by OMP_NUM_THREADS.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)
    return env


def _dynar(name, variant, ranks, mode, steps):
    """Summary of `python -m dynar.train` on `ranks` ranks (1: no mpiexec)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "dynar.train", "--model", name, "--dataset", "synthetic",
               "--batch-size", str(PER_RANK * ranks), "--max-steps", str(steps + WARMUP),
               "--threads", "1", "--eval-every", "0", "--log", log, "--sync", mode]
        if variant != "mnist":
            cmd += ["--variant", variant]
        if name == "alexnet":
            cmd += ["--dropout", "0"]
        if ranks > 1:
            cmd = _mpiexec(ranks) + cmd
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                             timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"dynar {name} x{ranks} {mode}: {out.stderr.strip()[-2000:]}")
        with open(log) as f:
            steps_ = [json.loads(line) for line in f]
    measured = [s for s in steps_ if s["event"] == "step"][WARMUP:]
    return {"step": [s["step_s"] for s in measured],
            "comm_exposed": [s["comm_exposed_s"] for s in measured],
            "compute": [s["compute_s"] for s in measured]}


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp(name, variant, ranks, steps):
    cmd = [sys.executable, "-m", "perf.dist", "--worker", name, variant, str(steps)]
    if ranks > 1:
        cmd = _mpiexec(ranks) + cmd
    # A fresh rendezvous port per launch: the previous job's may still be in TIME_WAIT.
    env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"DDP {name} x{ranks}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(name, variant, steps):
    """One rank of PyTorch DDP (gloo) under mpiexec, or a plain 1-process run without it."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch_reference
    torch.set_num_threads(1)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    model = torch_reference.build(name, variant)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    shape = {"mnist": (1, 28, 28), "cifar": (3, 32, 32)}[variant]
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.standard_normal((PER_RANK,) + shape, dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 10, PER_RANK).astype(np.int64))
    times = []
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"step": times}), flush=True)
    # gloo's background threads can outlive destroy_process_group and abort in C++ static
    # destructors at interpreter exit ("terminate called without an active exception");
    # the measurement is complete, so leave without running them.
    os._exit(0)


def run(quick=False):
    rounds = 1 if quick else 3
    rows, records = [], []
    for name, variant in MODELS:
        steps = (30 if name == "lenet" else 5) if quick else (100 if name == "lenet" else 12)
        runs = {}
        for _ in range(rounds):
            candidates = {("dynar", 1, "fused"): lambda: _dynar(name, variant, 1, "fused", steps),
                          ("ddp", 1, None): lambda: _ddp(name, variant, 1, steps)}
            for mode in MODES:
                candidates[("dynar", RANKS, mode)] = \
                    lambda mode=mode: _dynar(name, variant, RANKS, mode, steps)
            candidates[("ddp", RANKS, None)] = lambda: _ddp(name, variant, RANKS, steps)
            for key, fn in candidates.items():
                got = fn()
                for k, v in got.items():
                    runs.setdefault(key, {}).setdefault(k, []).extend(v)
        med = {key: {k: statistics.median(v) for k, v in val.items()} for key, val in runs.items()}
        base = {"dynar": PER_RANK / med[("dynar", 1, "fused")]["step"],
                "ddp": PER_RANK / med[("ddp", 1, None)]["step"]}
        ddp_rate = RANKS * PER_RANK / med[("ddp", RANKS, None)]["step"]
        for key in [("dynar", RANKS, m) for m in MODES] + [("ddp", RANKS, None)]:
            framework, ranks, mode = key
            rate = ranks * PER_RANK / med[key]["step"]
            rec = {"model": f"{name}-{variant}", "framework": framework, "sync": mode,
                   "ranks": ranks, "threads_per_rank": 1, "global_batch": ranks * PER_RANK,
                   "step_s": med[key]["step"], "images_per_sec": rate,
                   "comm_exposed_s": med[key].get("comm_exposed"),
                   "one_rank_images_per_sec": base[framework],
                   "scaling_efficiency": rate / (ranks * base[framework]),
                   "vs_ddp": rate / ddp_rate, "samples": runs[key]}
            records.append(rec)
            rows.append([rec["model"], "dynar " + mode if mode else "PyTorch DDP (gloo)",
                         f"{1000 * rec['step_s']:.1f}", f"{rate:,.0f}",
                         "-" if rec["comm_exposed_s"] is None
                         else f"{1000 * rec['comm_exposed_s']:.2f}",
                         f"{100 * rec['scaling_efficiency']:.0f}%", f"{rec['vs_ddp']:.2f}x"])
    table = harness.format_table(["model", "sync", "step ms", "img/s", "exposed comm ms",
                                  "scaling efficiency", "img/s vs DDP"], rows)
    print(table)
    print(f"\n{RANKS} ranks x 1 thread, {PER_RANK} images per rank; efficiency against each "
          f"framework's own 1-rank x 1-thread run at batch {PER_RANK}")
    path = harness.write_result("dist", {"runs": records, "table": table})
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("usage: python -m perf dist (this module's __main__ is the worker)")
