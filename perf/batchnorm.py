"""What BatchNorm over the global batch costs (`--batchnorm global` against `local`), on
resnet18-cifar and vgg16_bn-cifar, 32 images per rank, 1 thread per rank, `--sync buckets`
(25 MB buckets overlapped with backward, as DDP: a fixed plan, so the two modes differ in
BatchNorm alone; dynamic sync's exploration would also make the runs twice as long here):

(a) 2 ranks on this machine under mpiexec: one node replica, the sums go through the node's
    shared memory (dist/batch_stats.py);
(b) 4 emulated hosts x 1 rank at 10 Gbit/s (perf/cluster; needs root): recursive doubling
    over the shaped TCP links;
(c) the scale simulator's prediction for 1 ... 512 nodes (perf/scale.py,
    `predict_batchnorm`), on the Tianhe-3-like link;
(d) controls, paired runs only, that tell the network from the emulation's sharing of this
    machine's cores: 4 ranks on this machine (two a core, as (b), no network) and 2
    emulated hosts at 10 Gbit/s (the network, a core a rank).

The two modes alternate launch by launch (A B A B) and each figure is the median over the
measured steps of its launches (perf/dist.py's `_dynar`: warm-up steps excluded). Besides
the step-time difference, each run's log gives the seconds per step spent in BatchNorm's
sums (`batch_stats_s`); that figure includes waiting for the slowest rank, which a local run
spends at the gradient's allreduce instead. On a loaded machine those two figures are
launch noise, so the cost is also taken apart, each part measured on its own and robust to
that noise:
- the sums: one step's worth of BatchStatsGroup sums (nn.batchnorm.group_sum_sizes: 3C + 1
  values in forward, 2C in backward, for every BatchNorm of the model), timed after a
  barrier on the same launcher (`--worker`), median over rounds;
- the split kernels: every BatchNorm layer of one rank (32 images, 1 thread) on its own
  input shape, summing over a group of one (no communication: only the kernels split at
  their sums) against the fused kernels, alternated, medians.
And because this machine's speed drifts by tens of percent between launches, the two modes
also run paired in one launch (`--paired`): DataParallel with global BatchNorm, its layers'
group set or unset step by step (local, global, global, local, ...), each step timed on
rank 0; the cost is the median of each round's global / local.

    python -m perf batchnorm [--quick]
"""
import json
import statistics
import sys
import time
import types

from . import dist as dist_suite
from . import harness, scale

MODELS = [("resnet18", "cifar"), ("vgg16_bn", "cifar")]
STEPS = {"resnet18": 6, "vgg16_bn": 6}
RANKS = 2
CLUSTER_HOSTS, CLUSTER_RATE = 4, "10gbit"


def compare(launcher, models, rounds, steps_scale=1.0):
    """Records {model, network, ranks, batchnorm, step_s, batch_stats_s, ...} of both modes,
    and per model the overhead of global over local."""
    records = []
    for name, variant in models:
        steps = max(3, int(STEPS[name] * steps_scale))
        runs = {mode: {"step": [], "batch_stats": [], "comm_exposed": [], "launch_step": []}
                for mode in ("local", "global")}
        for _ in range(rounds):
            for mode in runs:
                got = dist_suite._dynar(launcher, name, variant, "buckets", steps,
                                        extra=["--batchnorm", mode])
                for key in ("step", "batch_stats", "comm_exposed"):
                    runs[mode][key] += got[key]
                runs[mode]["launch_step"].append(statistics.median(got["step"]))
        med = {mode: {k: statistics.median(v) for k, v in r.items()} for mode, r in runs.items()}
        overhead = med["global"]["step"] / med["local"]["step"] - 1
        for mode, r in runs.items():
            records.append({
                "model": f"{name}-{variant}", "network": launcher.label,
                "ranks": launcher.ranks, "batchnorm": mode, "sync": "buckets",
                "per_rank_batch": dist_suite.PER_RANK, "threads_per_rank": 1,
                "step_s": med[mode]["step"], "launch_step_s": r["launch_step"],
                "batch_stats_s": med[mode]["batch_stats"],
                "batch_stats_fraction": med[mode]["batch_stats"] / med[mode]["step"],
                "comm_exposed_s": med[mode]["comm_exposed"],
                "global_overhead": overhead, "samples": r})
    return records


class _Alone:
    """A batch statistics group of one process: the split kernels, no communication."""

    def allreduce_sum(self, array):
        pass


def split_kernel_cost(name, variant, repeats=15):
    """Seconds per step that BatchNorm's split kernels add to one rank's forward and backward
    (32 images, 1 thread): every BatchNorm layer of the model timed alone on its own input
    shape, fused kernels against split ones over a group of one (no communication),
    alternated; {"fused_s", "split_s", "extra_s"} sum the layers' medians. (A whole step
    would bury the difference in the rest of the step's noise on a loaded machine.)"""
    import numpy as np

    from dynar import kernels, models
    kernels.set_num_threads(1)
    model = models.get(name, num_classes=10, variant=variant)
    norms = model.batch_norm_layers()
    shapes = []
    for layer in norms:          # record each BatchNorm's input shape in one forward
        layer.forward = (lambda f: lambda x: (shapes.append(x.shape), f(x))[1])(layer.forward)
    rng = np.random.default_rng(0)
    model.forward(rng.standard_normal((dist_suite.PER_RANK,) + tuple(model.input_shape),
                                      dtype=np.float32))
    totals = {"fused": 0.0, "split": 0.0}
    samples = []
    for layer, shape in zip(norms, shapes):
        del layer.forward
        x = rng.standard_normal(shape, dtype=np.float32)
        dy = rng.standard_normal(shape, dtype=np.float32)

        def run(group, layer=layer, x=x, dy=dy):
            layer.batch_stats_group = group
            layer.forward(x)
            layer.backward(dy.copy())

        times = harness.alternate({"fused": lambda: run(None), "split": lambda: run(_Alone())},
                                  repeats, warmup=2)
        for key in totals:
            totals[key] += statistics.median(times[key])
        samples.append({"shape": list(shape), **times})
    return {"fused_s": totals["fused"], "split_s": totals["split"],
            "extra_s": totals["split"] - totals["fused"], "samples": samples}


def sums_cost(launcher, name, variant, rounds):
    """Seconds of one step's BatchNorm sums on `launcher`'s ranks (the --worker's result)."""
    argv = [sys.executable, "-m", "perf.batchnorm", "--worker", name, variant, str(rounds)]
    out = launcher.run(argv)
    if out.returncode != 0:
        raise RuntimeError(f"sums worker {name}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(name, variant, rounds):
    """One rank: the BatchStatsGroup DataParallel would build here, and `rounds` rounds of a
    step's sums over it, each after a barrier (so that a rank's lateness is not counted);
    rank 0 prints {"step_sums_s" (median), "samples", "group"}."""
    import numpy as np

    from dynar import models
    from dynar.dist import Job, node_replica
    from dynar.dist.batch_stats import BatchStatsGroup
    from dynar.nn.batchnorm import group_sum_sizes
    job = Job.start()
    model = models.get(name, num_classes=10, variant=variant)
    channels = [layer.num_features for layer in model.batch_norm_layers()]
    size = model.flat_params.size
    if node_replica.wanted(job.comm, size):
        node, cross = node_replica.split(job.comm)
        group = BatchStatsGroup(node=types.SimpleNamespace(node=node, cross=cross))
    else:
        group = BatchStatsGroup(comm=job.comm)
    buffers = [np.ones(n) for c in channels for n in group_sum_sizes(c)]
    times = []
    for _ in range(rounds):
        job.comm.Barrier()
        t0 = time.perf_counter()
        for buf in buffers:
            group.allreduce_sum(buf)
        times.append(time.perf_counter() - t0)
    described = group.describe()
    group.free()
    if job.rank == 0:
        print(json.dumps({"step_sums_s": statistics.median(times[2:]), "samples": times,
                          "group": described, "sums_per_step": len(buffers)}), flush=True)


def paired_cost(launcher, name, variant, rounds):
    """The --paired worker's result on `launcher`'s ranks: {"local_s", "global_s",
    "overhead", "samples"}."""
    argv = [sys.executable, "-m", "perf.batchnorm", "--paired", name, variant, str(rounds)]
    out = launcher.run(argv)
    if out.returncode != 0:
        raise RuntimeError(f"paired worker {name}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def paired_worker(name, variant, rounds):
    """One rank: training steps (32 images, 1 thread, --sync buckets) with BatchNorm over
    the global batch and over the rank's own share alternating in one launch, in rounds of
    local, global then global, local; rank 0 prints the medians and of each round's pairs
    the median global / local."""
    import numpy as np

    from dynar import kernels, models, nn, optim
    from dynar.dist import DataParallel, Job, SyncConfig
    kernels.set_num_threads(1)
    job = Job.start()
    model = models.get(name, num_classes=10, variant=variant)
    opt = optim.SGD(model, lr=0.01, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    rng = np.random.default_rng(job.rank)
    x = rng.standard_normal((dist_suite.PER_RANK,) + tuple(model.input_shape), dtype=np.float32)
    y = rng.integers(0, 10, dist_suite.PER_RANK)
    with DataParallel(model, opt, job, SyncConfig("buckets", batchnorm="global")) as dp:
        norms, group = model.batch_norm_layers(), dp.batch_stats

        def step(mode):
            for layer in norms:
                layer.batch_stats_group = group if mode == "global" else None
            start = time.perf_counter()
            model.zero_grad()
            crit.forward(model.forward(x), y)
            model.backward(crit.backward())
            dp.step()
            return time.perf_counter() - start

        for mode in ("local", "global") * 2:
            step(mode)
        times = {"local": [], "global": []}
        for r in range(rounds):
            for mode in ("local", "global") if r % 2 == 0 else ("global", "local"):
                times[mode].append(step(mode))
    if job.rank == 0:
        ratios = [g / l for g, l in zip(times["global"], times["local"])]
        print(json.dumps({"local_s": statistics.median(times["local"]),
                          "global_s": statistics.median(times["global"]),
                          "overhead": statistics.median(ratios) - 1, "samples": times}),
              flush=True)


def breakdown(launcher, local_records, quick):
    """Per model: the split kernels' extra compute and the sums' cost on `launcher`, against
    the local mode's step time measured there."""
    rows = []
    for name, variant in MODELS:
        kernels = split_kernel_cost(name, variant, repeats=9 if quick else 15)
        sums = sums_cost(launcher, name, variant, rounds=10 if quick else 30)
        paired = paired_cost(launcher, name, variant, rounds=6 if quick else 16)
        step = next(r["step_s"] for r in local_records
                    if r["model"] == f"{name}-{variant}" and r["batchnorm"] == "local")
        rows.append({"model": f"{name}-{variant}", "network": launcher.label,
                     "ranks": launcher.ranks, "local_step_s": step,
                     "split_kernels_s": kernels["extra_s"], "sums_s": sums["step_sums_s"],
                     "sums_per_step": sums["sums_per_step"], "group": sums["group"],
                     "overhead": (kernels["extra_s"] + sums["step_sums_s"]) / step,
                     "paired_local_s": paired["local_s"], "paired_global_s": paired["global_s"],
                     "paired_overhead": paired["overhead"],
                     "kernel_samples": kernels["samples"], "sum_samples": sums["samples"],
                     "paired_samples": paired["samples"]})
    return rows


def controls(launchers, quick):
    """(d): each model's paired cost on each launcher."""
    return [{"model": f"{name}-{variant}", "network": launcher.label, "ranks": launcher.ranks,
             **paired_cost(launcher, name, variant, rounds=6 if quick else 16)}
            for launcher in launchers for name, variant in MODELS]


def controls_table(rows):
    return harness.format_table(
        ["model", "network", "ranks", "paired steps, local / global ms",
         "global's cost, paired"],
        [[r["model"], r["network"], r["ranks"],
          f"{1000 * r['local_s']:.0f} / {1000 * r['global_s']:.0f}",
          f"{100 * r['overhead']:+.2f}%"] for r in rows])


def breakdown_table(rows):
    return harness.format_table(
        ["model", "network", "ranks", "local step ms", "split kernels ms/step",
         "sums ms/step (count, how)", "kernels + sums", "paired steps, local / global ms",
         "global's cost, paired"],
        [[r["model"], r["network"], r["ranks"], f"{1000 * r['local_step_s']:.0f}",
          f"{1000 * r['split_kernels_s']:+.1f}",
          f"{1000 * r['sums_s']:.2f} ({r['sums_per_step']}, {' + '.join(r['group'])})",
          f"{100 * r['overhead']:+.2f}%",
          f"{1000 * r['paired_local_s']:.0f} / {1000 * r['paired_global_s']:.0f}",
          f"{100 * r['paired_overhead']:+.2f}%"] for r in rows])


def table(records):
    rows = []
    for r in records:
        launches = r["launch_step_s"]
        rows.append([r["model"], r["network"], r["ranks"], r["batchnorm"],
                     f"{1000 * r['step_s']:.0f} ({1000 * min(launches):.0f}-"
                     f"{1000 * max(launches):.0f})",
                     f"{1000 * r['batch_stats_s']:.1f} ({100 * r['batch_stats_fraction']:.1f}%)",
                     f"{1000 * r['comm_exposed_s']:.1f}",
                     f"{100 * r['global_overhead']:+.1f}%" if r["batchnorm"] == "global" else ""])
    return harness.format_table(
        ["model", "network", "ranks", "batchnorm", "step ms (launches)",
         "BatchNorm sums ms/step (of step)", "exposed comm ms", "global vs local"], rows)


def predictions(quick):
    """(c): the simulator's step time with global against local BatchNorm, per node count,
    one rank per node with all of this machine's cores, on the Tianhe-3-like link and on
    the emulated cluster's 10 Gbit/s links (their fitted α-β model)."""
    import os
    gamma, _ = scale.measure_gamma(repeats=3 if quick else 5)
    links = {scale.PRIMARY_LINK: scale.tianhe3_link(gamma),
             "emulated 10 Gbit/s": scale.emulated_fit(10, gamma)[0]}
    rows = []
    for name, variant in MODELS:
        prof = scale.profile(name, variant, threads=len(os.sched_getaffinity(0)),
                             steps=3 if quick else 6)
        for label, link in links.items():
            rows += [dict(row, link=label, threads=prof["threads"])
                     for row in scale.predict_batchnorm(prof, link)]
    return rows


def prediction_table(rows, nodes=(2, 4, 64, 512)):
    return harness.format_table(
        ["model", "link", "nodes", "local step ms", "global step ms", "BatchNorm sums ms/step",
         "global vs local"],
        [[r["model"], r["link"], r["nodes"], f"{1000 * r['local_step_s']:.1f}",
          f"{1000 * r['global_step_s']:.1f}", f"{1000 * r['batch_stats_s']:.2f}",
          f"{100 * r['overhead']:+.2f}%"] for r in rows if r["nodes"] in nodes])


def run(quick=False):
    local = dist_suite.LocalLauncher(RANKS)
    records = compare(local, MODELS, rounds=1 if quick else 2,
                      steps_scale=0.5 if quick else 1.0)
    parts = breakdown(local, records, quick)
    control_rows = controls([dist_suite.LocalLauncher(CLUSTER_HOSTS)], quick)
    tables = [table(records), breakdown_table(parts)]
    print("\n\n".join(tables) + "\n", flush=True)
    from .cluster import cluster, network, suite as cluster_suite
    ok, reason = network.probe()
    if ok:
        import tempfile
        with tempfile.TemporaryDirectory() as tune_dir, \
                cluster.Cluster(hosts=CLUSTER_HOSTS, ranks_per_host=1, rate=CLUSTER_RATE) as c:
            launcher = cluster_suite._Launcher(c, CLUSTER_HOSTS, 1, CLUSTER_RATE, tune_dir)
            cluster_records = compare(launcher, MODELS, rounds=1,
                                      steps_scale=0.5 if quick else 1.0)
            cluster_parts = breakdown(launcher, cluster_records, quick)
        with tempfile.TemporaryDirectory() as tune_dir, \
                cluster.Cluster(hosts=2, ranks_per_host=1, rate=CLUSTER_RATE) as c:
            launcher = cluster_suite._Launcher(c, 2, 1, CLUSTER_RATE, tune_dir)
            control_rows += controls([launcher], quick)
        records += cluster_records
        parts += cluster_parts
        tables += [table(cluster_records), breakdown_table(cluster_parts)]
        print("\n\n".join(tables[-2:]) + "\n", flush=True)
    else:
        print(f"emulated cluster skipped: {reason}\n")
    tables.append(controls_table(control_rows))
    print(tables[-1] + "\n", flush=True)
    rows = predictions(quick)
    tables.append(prediction_table(rows))
    print(tables[-1], flush=True)
    path = harness.write_result("batchnorm", {"quick": quick, "records": records,
                                              "breakdown": parts, "controls": control_rows,
                                              "predictions": rows,
                                              "cluster": ok or reason,
                                              "table": "\n\n".join(tables)})
    print(f"\nwrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) == 5 and sys.argv[1] == "--paired":
        paired_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("usage: python -m perf batchnorm (this module's __main__ is its workers)")
