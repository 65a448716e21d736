"""Data-parallel training: dynar's sync modes against PyTorch DDP (gloo), same launcher.

Protocol (issues 4 and 6): R ranks x 1 compute thread, 32 images per rank (global batch
32 R), synthetic data, SGD momentum 0.9. Scaling efficiency = R-rank img/s / (R x img/s of
one rank x 1 thread at batch 32), each framework against its own 1-rank baseline, all in one
run, frameworks alternated round by round; medians over the measured steps. Dynamic sync's
exploration (measuring, then trying its candidate plans) is excluded from its measured
steps, as every run's warm-up is: the figures are steady state. The cost of exploring is
reported separately (steps it took).

`compare(launcher, ...)` runs the same comparison through any launcher: mpiexec on this
machine (`python -m perf dist`), or the emulated cluster (perf/cluster).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from dynar.dist import online, runtime

from . import harness
from .models import ROOT, WARMUP

MODELS = [("lenet", "mnist"), ("alexnet", "cifar"), ("vgg16_bn", "cifar"), ("resnet18", "cifar")]
QUICK_MODELS = [("lenet", "mnist"), ("alexnet", "cifar")]
MODES = ["per-layer", "fused", "buckets", "dynamic"]
RANKS, PER_RANK = 2, 32
STEPS = {"lenet": 100, "alexnet": 12, "vgg16_bn": 6, "resnet18": 6}


def _mpiexec(ranks):
    exe = runtime.find_mpiexec() or "mpiexec"
    # Unbound: DDP's gloo and dynar's communication thread each run a helper thread beside
    # the compute thread; binding a rank to one core would make them share it.
    return [exe, *runtime.shared_machine_flags(exe), "-n", str(ranks)]


def _env():
    # Threads are set by each framework's own flag (--threads 1, torch.set_num_threads(1)),
    # as a user would, not by OMP_NUM_THREADS.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)
    return env


class LocalLauncher:
    """Ranks on this machine under mpiexec (shared memory between them)."""
    label = "loopback"

    def __init__(self, ranks):
        self.ranks = ranks

    def run(self, argv, env=None, timeout=1800):
        return subprocess.run(_mpiexec(self.ranks) + argv, capture_output=True, text=True,
                              cwd=ROOT, env=dict(_env(), **(env or {})), timeout=timeout)

    def rendezvous_address(self):
        return "127.0.0.1"


def _single(argv, env=None):
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env=dict(_env(), **(env or {})), timeout=1800)


def _explore_steps(step_s):
    """Steps dynamic sync may spend exploring (measuring, then two trial blocks per
    candidate plan) before it runs its choice, for steps of about step_s seconds (None:
    unknown). A trial's length follows the step's sync figure, half a step or more."""
    return online.exploration_steps(0.0 if step_s is None else step_s / 2)


def _dynar(launcher, name, variant, mode, steps, step_s=None, env=None, extra=()):
    """Per-step figures of `python -m dynar.train` (launcher None: one process); step_s,
    the step time another mode measured, sizes dynamic sync's exploration; extra: more
    flags."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        # Dynamic sync explores first (measure, then one trial per candidate plan): give it
        # the steps for that on top of the measured ones.
        explore = _explore_steps(step_s) if mode == "dynamic" else 0
        ranks = launcher.ranks if launcher else 1
        argv = [sys.executable, "-m", "dynar.train", "--model", name, "--dataset", "synthetic",
                "--batch-size", str(PER_RANK * ranks),
                "--max-steps", str(steps + WARMUP + explore), "--threads", "1",
                "--eval-every", "0", "--log", log, "--sync", mode]
        if variant != "mnist":
            argv += ["--variant", variant]
        if name == "alexnet":
            argv += ["--dropout", "0"]
        argv += list(extra)
        out = launcher.run(argv, env) if launcher else _single(argv, env)
        if out.returncode != 0:
            raise RuntimeError(f"dynar {name} x{ranks} {mode}: {out.stderr.strip()[-2000:]}")
        with open(log) as f:
            records = [json.loads(line) for line in f]
    chosen = [r for r in records if r["event"] == "plan" and r["phase"] == "chosen"]
    summary = records[-1] if records and records[-1]["event"] == "summary" else {}
    one_node = (summary.get("node_replica") or {}).get("nodes") == 1
    if mode == "dynamic" and not chosen and not one_node:
        raise RuntimeError(f"dynar {name} x{ranks} dynamic: no plan chosen in {len(records)} "
                           f"log records")
    first = chosen[0]["step"] + 1 if chosen else WARMUP
    measured = [r for r in records if r["event"] == "step" and r["step"] > first][-steps:]
    got = {"step": [s["step_s"] for s in measured],
           "comm_exposed": [s["comm_exposed_s"] for s in measured],
           "compute": [s["compute_s"] for s in measured],
           "batch_stats": [s.get("batch_stats_s", 0.0) for s in measured]}
    if chosen:
        got["plan"] = [f"{chosen[-1]['candidate']}: {chosen[-1]['buckets']} buckets "
                       + ", ".join(f"{a} x{n}" for a, n in chosen[-1]["algorithms"].items())]
        got["explore_steps"] = [chosen[0]["step"]]
    elif mode == "dynamic" and one_node:
        got["plan"] = ["one node replica: no allreduce to plan"]
    return got


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp(launcher, name, variant, steps):
    argv = [sys.executable, "-m", "perf.dist", "--worker", name, variant, str(steps)]
    if launcher is None:
        out = _single(argv, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    else:
        # A fresh rendezvous port per launch: the previous job's may still be in TIME_WAIT.
        out = launcher.run(argv, {"MASTER_ADDR": launcher.rendezvous_address(),
                                  "MASTER_PORT": str(_free_port())})
    if out.returncode != 0:
        raise RuntimeError(f"DDP {name}: {out.stderr.strip()[-2000:]}")
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


# `buckets` again with every rank keeping its own replica (DYNAR_NODE_REPLICA=off), where
# ranks share a node: what the node replica (dist/node_replica.py) is measured against.
PER_RANK_REPLICA = "buckets, a replica per rank"


def compare(launcher, models, rounds, steps_scale=1.0, single_rank=True, replica_baseline=False):
    """Records for each model: dynar's modes and DDP on `launcher`'s ranks, plus each
    framework's 1-rank baseline (single_rank) for scaling efficiency, and buckets with a
    replica per rank (replica_baseline)."""
    records = []
    for name, variant in models:
        steps = max(3, int(STEPS[name] * steps_scale))
        runs = {}
        fused = ("dynar", launcher.ranks, "fused")   # runs before dynamic (MODES order)

        def fused_step_s():
            return statistics.median(runs[fused]["step"]) if fused in runs else None

        candidates = {("ddp", launcher.ranks, None): lambda: _ddp(launcher, name, variant, steps)}
        for mode in MODES:
            candidates[("dynar", launcher.ranks, mode)] = \
                lambda mode=mode: _dynar(launcher, name, variant, mode, steps, fused_step_s())
        modes = list(MODES)
        if replica_baseline:
            modes.append(PER_RANK_REPLICA)
            candidates[("dynar", launcher.ranks, PER_RANK_REPLICA)] = \
                lambda: _dynar(launcher, name, variant, "buckets", steps,
                               env={"DYNAR_NODE_REPLICA": "off"})
        if single_rank:
            candidates[("dynar", 1, "fused")] = lambda: _dynar(None, name, variant, "fused", steps)
            candidates[("ddp", 1, None)] = lambda: _ddp(None, name, variant, steps)
        for _ in range(rounds):
            for key, fn in candidates.items():
                got = fn()
                for k, v in got.items():
                    runs.setdefault(key, {}).setdefault(k, []).extend(v)
                # Each launch's own median: their spread is the launch-to-launch noise
                runs[key].setdefault("launch_step", []).append(statistics.median(got["step"]))
        med = {key: {k: statistics.median(v) for k, v in val.items()
                     if k not in ("plan", "launch_step")}
               for key, val in runs.items()}
        ddp_rate = launcher.ranks * PER_RANK / med[("ddp", launcher.ranks, None)]["step"]
        for key in [("dynar", launcher.ranks, m) for m in modes] + [("ddp", launcher.ranks, None)]:
            framework, ranks, mode = key
            rate = ranks * PER_RANK / med[key]["step"]
            rec = {"model": f"{name}-{variant}", "network": launcher.label,
                   "framework": framework, "sync": mode, "ranks": ranks,
                   "threads_per_rank": 1, "global_batch": ranks * PER_RANK,
                   "step_s": med[key]["step"], "launch_step_s": runs[key]["launch_step"],
                   "images_per_sec": rate,
                   "comm_exposed_s": med[key].get("comm_exposed"),
                   "compute_s": med[key].get("compute"),
                   "plan": runs[key].get("plan"), "vs_ddp": rate / ddp_rate,
                   "samples": runs[key]}
            if single_rank:
                one = med[(framework, 1, "fused" if framework == "dynar" else None)]["step"]
                rec["one_rank_images_per_sec"] = PER_RANK / one
                rec["scaling_efficiency"] = rate / (ranks * PER_RANK / one)
            records.append(rec)
    return records


def _step_ms(record):
    """The median step, and with several launches the range of their own medians."""
    text = f"{1000 * record['step_s']:.1f}"
    launches = record.get("launch_step_s") or []
    if len(launches) > 1:
        text += f" ({1000 * min(launches):.1f}-{1000 * max(launches):.1f})"
    return text


def table(records):
    rows = []
    for r in records:
        eff = r.get("scaling_efficiency")
        rows.append([r["model"], r["network"], r["ranks"],
                     "dynar " + r["sync"] if r["sync"] else "PyTorch DDP (gloo)",
                     _step_ms(r), f"{r['images_per_sec']:,.0f}",
                     "-" if r["comm_exposed_s"] is None else f"{1000 * r['comm_exposed_s']:.2f}",
                     "-" if eff is None else f"{100 * eff:.0f}%", f"{r['vs_ddp']:.2f}x",
                     (r.get("plan") or [""])[-1]])
    return harness.format_table(["model", "network", "ranks", "sync", "step ms (launches)", "img/s",
                                 "exposed comm ms", "scaling efficiency", "img/s vs DDP",
                                 "dynamic's plan"], rows)


def run(quick=False):
    records = compare(LocalLauncher(RANKS), QUICK_MODELS if quick else MODELS,
                      rounds=1 if quick else 2, steps_scale=0.5 if quick else 1.0,
                      replica_baseline=True)
    text = table(records)
    print(text)
    print(f"\n{RANKS} ranks x 1 thread, {PER_RANK} images per rank; efficiency against each "
          f"framework's own 1-rank x 1-thread run at batch {PER_RANK}")
    path = harness.write_result("dist", {"runs": records, "table": text})
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("usage: python -m perf dist (this module's __main__ is the worker)")
