"""Scale simulator: predicted step time, exposed communication and weak-scaling efficiency of
data-parallel training on 1 ... 512 nodes, for every sync mode, from measurements taken here.

`python -m perf scale [--quick]`. The prediction has three inputs:

1. **A profile of one node** (`profile()`): the dynar model trained in this process on a
   per-rank batch of 32 synthetic N(0,1) images (weak scaling: the per-rank batch stays
   fixed as nodes are added, as in the dist suite), timing forward (+ loss), backward and
   the SGD update (momentum 0.9), and recording the moment backward finalizes each layer's
   gradient (`model.register_grad_ready_hook`) - the same per-layer ready times Dynamic
   Allreduce plans from. Medians over steps after warm-up. Dropout is off (p = 0) for
   alexnet and vgg, as in the peer benchmarks: it changes compute, not communication.
2. **A link model** (α, β, γ; dynar.dist.costmodel.LinkModel), one of:
   - `loopback-fit`: `costmodel.fit_link` over the allreduce suite's loopback measurements
     (dynar ring, recursive doubling, Rabenseifner at several sizes and rank counts): this
     machine's shared memory as if it were the interconnect. Those runs put up to 4 ranks
     on 2 cores, which inflates the fit; it is an optimistic-bandwidth, pessimistic-CPU
     reference, not a cluster.
   - `emulated-fit`: the emulated cluster's links (perf/cluster: namespaces joined by
     `tc tbf`-shaped veth links) at VALIDATION_GBIT. β = 8 / (η · rate) with η the payload
     fraction of the shaped rate and α the per-message latency, both fitted (least squares,
     γ held at the value below) to the cluster suite's MPI_Allreduce probes in
     perf/results/cluster.json when those exist; otherwise η = TCP's 1448/1514 and α from
     the loopback fit, and the output says so.
   - `tianhe3-like`: a Tianhe-3-like 2D-mesh interconnect: α = 1.5 µs, β = 1 / (100 Gbit/s),
     and γ measured here.
   γ (seconds per byte reduced) is measured as numpy `a += b` on two 64 MB float32 arrays,
   single-threaded, divided by the 64 MB of one operand: one streaming read-read-write pass,
   the work an allreduce does per byte it reduces (`measure_gamma()`).
3. **The planner** (dynar.dist.planner): for N nodes, `CostModel.from_link(link, N, 1)` gives
   every algorithm's α + β·n on that communicator (Open MPI's own allreduce, "mpi", is
   extrapolated with ring's shape); the fixed modes are `planner.fixed_plan` (per-layer
   blocking, one fused allreduce after backward, 25 MB buckets, all with "mpi") and
   dynamic is `planner.plan` (exact optimum over bucket cuts and per-bucket algorithms).

    step(N)       = forward + backward + exposed(N) + update
    exposed(N)    = the plan's predicted exposed communication (for per-layer: every
                    blocking allreduce, since backward waits for each one)
    efficiency(N) = step(1) / step(N)    (weak scaling: same work per node; step(1) has no
                                          communication, so it is the same for every mode)

Assumptions, stated so the numbers can be judged:
- One rank per node with all the node's cores (threads = cores, ranks_per_node = 1): the
  node is this machine; the many-core hierarchical allreduce is therefore plain ring over
  nodes here.
- Communication and computation do not slow each other down (the communication thread's
  reductions, the TCP stack and memory bandwidth are taken as free for backward), every node
  computes as fast as the profiled one (no stragglers), and the network has no contention
  beyond what the α-β model of each algorithm charges (a 2D mesh's multi-hop paths are not
  modelled: α stays 1.5 µs at any distance).
- The data loader, logging and Python overhead outside forward/backward/update are not in
  the profile; measured step times include them.

Validation (`validate()`): predictions against training runs on the emulated cluster
(alexnet-cifar, 2 and 4 hosts × 1 rank, VALIDATION_GBIT, each sync mode). Those runs give
each rank one compute thread, and every emulated host shares this machine's cores, so the
validation profile is taken at threads = 1 and its compute is slowed by
max(1, total ranks / cores) (`compute_slowdown()`): 4 one-thread ranks on 2 cores each get
half a core. γ is slowed alike (reductions run on the same cores). The relative error is
reported next to every prediction, within TOLERANCE or not.
"""
import glob
import json
import os
import statistics
import time

import numpy as np

from dynar.dist import costmodel, online, planner

from . import harness, plots

MODELS = [("lenet", None), ("alexnet", "cifar"), ("vgg16_bn", "cifar"), ("resnet18", "cifar")]
NODES = [2 ** k for k in range(10)]                   # 1 ... 512
SYNC_MODES = ("per-layer", "fused", "buckets", "dynamic")
PER_RANK_BATCH = 32
BUCKET_BYTES = planner.DEFAULT_BUCKET_BYTES          # sync.py's default, PyTorch DDP's
INPUT_SHAPES = {None: (1, 28, 28), "mnist": (1, 28, 28), "cifar": (3, 32, 32),
                "imagenet": (3, 224, 224)}
WARMUP = 3

TIANHE3_ALPHA_S = 1.5e-6
TIANHE3_BIT_S = 100e9
# Payload share of a shaped Ethernet link for one TCP stream at MTU 1500 (perf/cluster's
# network.TCP_GOODPUT_FRACTION): the default η when the cluster suite has not measured one.
TCP_GOODPUT_FRACTION = 1448 / 1514

VALIDATION_MODEL = "alexnet-cifar"
VALIDATION_HOSTS = (2, 4)
VALIDATION_GBIT = 10
TOLERANCE = 0.25
NOISY = 1.5          # profile spread (slowest / fastest step) above which the output warns
PRIMARY_LINK = "tianhe3-like"
# The dynar allreduce suite's method names -> costmodel algorithms used for the loopback fit.
# Only the flat algorithms: their cost does not depend on how ranks sit on nodes, which the
# loopback records do not say. "mpi" is left out: the library's choice has no fixed shape.
FIT_METHODS = {"dynar ring": "ring", "dynar recursive_doubling": "recursive_doubling",
               "dynar rabenseifner": "rabenseifner"}
NO_MEASUREMENTS = "validation: no emulated-cluster measurements yet (run python -m perf cluster)"


def model_key(name, variant):
    return name if variant is None else f"{name}-{variant}"


# -- inputs: profile, γ, links -------------------------------------------------------------


def profile(name, variant=None, batch=PER_RANK_BATCH, threads=1, steps=10, warmup=WARMUP):
    """Time `steps` training steps of dynar's `name` model after `warmup` untimed ones.

    Returns a JSON-able dict: model, threads, batch, forward_s (a lazy zero_grad + forward +
    loss; the zeroing itself falls in backward), backward_s, update_s (medians), and per layer in the order backward finalizes them
    (`model.grad_ready_order()`): layers, sizes_bytes (4 · slice length), ready_s (median
    seconds from the start of backward to the layer's grad-ready hook), batchnorm ([index
    in layers, channels] of each BatchNorm), plus the samples."""
    from dynar import kernels, models, nn, optim
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    before = kernels.get_num_threads()
    kernels.set_num_threads(threads)
    kernels.set_flush_denormals(True)       # as dynar.train does
    try:
        kw = {} if variant is None else {"variant": variant}
        if name.startswith(("alexnet", "vgg")):
            kw["dropout"] = 0.0
        model = models.get(name, num_classes=10, **kw)
        crit = nn.CrossEntropyLoss()
        opt = optim.SGD(model, lr=0.01, momentum=0.9)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch,) + INPUT_SHAPES[variant], dtype=np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)
        order = model.grad_ready_order()
        marks = []
        handle = model.register_grad_ready_hook(lambda start, stop: marks.append(
            time.perf_counter()))
        samples = {"forward_s": [], "backward_s": [], "update_s": [], "ready_s": []}
        for i in range(warmup + steps):
            marks.clear()
            t0 = time.perf_counter()
            model.zero_grad(lazy=True)
            crit.forward(model.forward(x), y)
            t1 = time.perf_counter()
            model.backward(crit.backward())
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if len(marks) != len(order):
                raise RuntimeError(f"{name}: {len(marks)} grad-ready hooks fired for "
                                   f"{len(order)} layers")
            if i >= warmup:
                samples["forward_s"].append(t1 - t0)
                samples["backward_s"].append(t2 - t1)
                samples["update_s"].append(t3 - t2)
                samples["ready_s"].append([m - t1 for m in marks])
        handle.remove()
    finally:
        kernels.set_num_threads(before)
    # A coordinate-wise median of nondecreasing vectors is nondecreasing; the accumulate only
    # guards the planner's input check against float ties.
    ready = np.maximum.accumulate(np.median(np.array(samples["ready_s"]), axis=0))
    layers = [layer for layer, _, _, _ in order]
    norms = {id(m) for m in model.batch_norm_layers()}
    return {"model": model_key(name, variant), "name": name, "variant": variant,
            "batch": batch, "threads": threads, "steps": steps, "warmup": warmup,
            "forward_s": statistics.median(samples["forward_s"]),
            "backward_s": statistics.median(samples["backward_s"]),
            "update_s": statistics.median(samples["update_s"]),
            "layers": layers,
            "sizes_bytes": [4 * (stop - start) for _, _, start, stop in order],
            "batchnorm": [[layers.index(name), m.num_features]
                          for name, m in model.named_modules() if id(m) in norms],
            "ready_s": [float(r) for r in ready],
            "samples": samples}


def spread(prof):
    """max / min of a profile's step-compute samples: near 1 on an idle machine; well above
    it means other work shared the cores while profiling and the medians are suspect."""
    total = [sum(t) for t in zip(prof["samples"]["forward_s"], prof["samples"]["backward_s"],
                                 prof["samples"]["update_s"])]
    return max(total) / min(total)


def measure_gamma(nbytes=64 << 20, repeats=5):
    """Seconds per byte of numpy `a += b` on float32 arrays of nbytes each (one thread):
    median of `repeats` after one warm-up. Returns (gamma, samples)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    a += b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a += b
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / a.nbytes, times


def tianhe3_link(gamma):
    """The Tianhe-3-like interconnect: α = 1.5 µs, β = 1 / (100 Gbit/s), γ as given."""
    return costmodel.LinkModel(alpha=TIANHE3_ALPHA_S, beta=8 / TIANHE3_BIT_S, gamma=gamma)


def loopback_samples(records, network="loopback"):
    """fit_link samples from allreduce-suite records of one network ("loopback", or the
    cluster suite's "emulated Hx1 @ RATE" runs when network is e.g. "@ 10gbit")."""
    return [(FIT_METHODS[r["method"]], r["ranks"], 1, r["bytes"], r["time_s"])
            for r in records
            if (r.get("network") == network or (network != "loopback" and str(
                r.get("network", "")).startswith("emulated") and r["network"].endswith(network)))
            and r.get("method") in FIT_METHODS
            and r.get("ranks", 1) > 1 and r.get("time_s", 0) > 0]


def emulated_link(probes, gamma, rate_gbit=VALIDATION_GBIT, fallback_alpha=5e-6):
    """(LinkModel of the emulated cluster at rate_gbit, how it was obtained).

    probes: the cluster suite's MPI_Allreduce records (case "allreduce", hosts, ranks,
    ranks_per_host, bytes, time_s, configured_bit_s); only one-rank-per-host ones are used,
    at any rate. Model: time = lat·α + bw·n·8 / (η·rate) + red·n·γ with Open MPI's
    allreduce priced like ring; α and 1/η are fitted by nonnegative least squares on relative
    error when the probes separate them, else η = TCP_GOODPUT_FRACTION and only α is
    fitted; without probes α = fallback_alpha."""
    from scipy.optimize import nnls
    rows, seconds = [], []
    for r in probes:
        if r.get("ranks_per_host", 1) != 1 or r.get("ranks", 1) < 2 or not r.get("time_s"):
            continue
        lat, bw, red = costmodel.terms("mpi", r["ranks"])
        rows.append((lat, bw * r["bytes"] * 8 / r["configured_bit_s"]))
        seconds.append(r["time_s"] - red * r["bytes"] * gamma)
    eta, alpha = TCP_GOODPUT_FRACTION, fallback_alpha
    if not rows:
        source = (f"not fitted (no cluster MPI_Allreduce probes): η = 1448/1514 of "
                  f"{rate_gbit} Gbit/s, α from the loopback fit")
    else:
        # Relative errors (divide by the time), columns scaled to unit norm: α and 1/η
        # differ by ~10^5 in magnitude.
        a = np.array(rows) / np.array(seconds)[:, None]
        if np.linalg.matrix_rank(a / np.linalg.norm(a, axis=0)) >= 2:
            norms = np.linalg.norm(a, axis=0)
            x, _ = nnls(a / norms, np.ones(len(seconds)))
            x = x / norms
            alpha, eta = float(x[0]), (1 / x[1] if x[1] > 0 else TCP_GOODPUT_FRACTION)
            source = f"α, η fitted to {len(rows)} cluster MPI_Allreduce probes"
        else:
            y = np.array(seconds) - np.array(rows)[:, 1] / eta
            alpha = max(0.0, float(np.mean(y / np.array(rows)[:, 0])))
            source = (f"α fitted to {len(rows)} cluster MPI_Allreduce probe(s), η = 1448/1514 "
                      f"(one probe shape cannot separate them)")
    link = costmodel.LinkModel(alpha=alpha, beta=8 / (eta * rate_gbit * 1e9), gamma=gamma)
    return link, {"source": source, "eta": eta, "rate_gbit": rate_gbit, "probes": len(rows)}


def emulated_fit(rate_gbit, gamma, fallback_alpha=5e-6):
    """(LinkModel, how it was obtained) of the emulated cluster at rate_gbit. Preferred:
    dynar's own algorithms measured on the emulated hosts at this rate (the cluster suite's
    allreduce part, 4 B to 64 MB), fitted like the loopback link; else emulated_link() over
    the MPI_Allreduce probes."""
    samples = loopback_samples(_records(_load("cluster.json")), f"@ {rate_gbit:g}gbit")
    try:
        fitted = costmodel.fit_link(samples)
        if not fitted.beta > 0:
            raise ValueError("no per-byte wire cost")
        return fitted, {"source": f"fit_link over {len(samples)} emulated-cluster "
                                  f"allreduce records at {rate_gbit:g} Gbit/s"}
    except ValueError:
        return emulated_link(cluster_probes(), gamma, rate_gbit, fallback_alpha=fallback_alpha)


# -- prediction ----------------------------------------------------------------------------


def compute_slowdown(total_ranks, cores):
    """How much slower each rank computes when `total_ranks` one-thread ranks share `cores`
    cores (all emulated hosts run on this machine): max(1, total_ranks / cores)."""
    if total_ranks < 1 or cores < 1:
        raise ValueError(f"total_ranks and cores must be >= 1, got {total_ranks}, {cores}")
    return max(1.0, total_ranks / cores)


def _serial_exposed(plan, sizes, cost):
    """Exposed time of `plan` when nothing overlaps: every bucket's full cost."""
    return float(sum(cost.time(b.algorithm, int(sizes[b.first:b.stop].sum()))
                     for b in plan.buckets))


def predict_step(prof, link, nodes, mode, ranks_per_node=1, slowdown=1.0,
                 bucket_bytes=BUCKET_BYTES, overlap=True):
    """Predicted {step_s, exposed_s, buckets, algorithms} of one sync mode on `nodes` nodes ×
    ranks_per_node ranks, compute (forward, backward, update, ready times) × slowdown.

    overlap=False models nodes with no core to spare (every core computes, and the
    transfers' copies, sums and TCP work need cores too): communication beside backward
    slows backward by as much as it hides, so every plan exposes all of its communication,
    and dynamic sync's trials (dist/online.py) keep the candidate with the least of it."""
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown sync mode {mode!r}; choose one of {', '.join(SYNC_MODES)}")
    ranks = nodes * ranks_per_node
    cost = costmodel.CostModel.from_link(link, ranks, ranks_per_node)
    sizes = np.asarray(prof["sizes_bytes"], dtype=np.int64)
    ready = np.asarray(prof["ready_s"], dtype=np.float64) * slowdown
    if mode == "dynamic":
        plan = planner.plan(sizes, ready, cost)
    else:
        plan = planner.fixed_plan(sizes, ready, cost, mode, bucket_bytes, "mpi")
    compute = (prof["forward_s"] + prof["backward_s"] + prof["update_s"]) * slowdown
    exposed = plan.predicted_exposed_s
    if not overlap:
        exposed = _serial_exposed(plan, sizes, cost)
        if mode == "dynamic":
            # What the online trials pick among (dist/online.py): the least communication.
            exposed = min(_serial_exposed(tried, sizes, cost) for _, tried in online.candidates(
                sizes, ready, cost, cost.algorithms, bucket_bytes))
    return {"step_s": compute + exposed, "exposed_s": exposed, "buckets": len(plan.buckets),
            "algorithms": sorted({b.algorithm for b in plan.buckets})}


def predict(prof, link, nodes=NODES, modes=SYNC_MODES, bucket_bytes=BUCKET_BYTES):
    """Rows {model, mode, nodes, step_s, exposed_s, efficiency, buckets, algorithms} for every
    node count and mode (one rank per node); efficiency = step(1 node) / step(N)."""
    rows = []
    for mode in modes:
        base = predict_step(prof, link, 1, mode, bucket_bytes=bucket_bytes)["step_s"]
        for n in nodes:
            got = predict_step(prof, link, n, mode, bucket_bytes=bucket_bytes)
            rows.append({"model": prof["model"], "mode": mode, "nodes": n, **got,
                         "efficiency": base / got["step_s"]})
    return rows


def batchnorm_sums_s(prof, link, nodes):
    """(forward, backward) seconds per step of global BatchNorm's sums over `nodes` nodes (a
    rank each; dist/batch_stats.py: recursive doubling): per layer of C channels, one sum in
    forward and one in backward (nn.batchnorm.group_sum_sizes); and the backward sums'
    seconds per layer."""
    from dynar.nn.batchnorm import group_sum_sizes

    def one(values):
        return link.time("recursive_doubling", 8 * values, nodes)
    forward = sum(one(group_sum_sizes(c)[0]) for _, c in prof["batchnorm"])
    backward = [one(group_sum_sizes(c)[1]) for _, c in prof["batchnorm"]]
    return forward, sum(backward), backward


def predict_batchnorm(prof, link, nodes=NODES, mode="buckets", bucket_bytes=BUCKET_BYTES):
    """Rows {model, nodes, mode, local_step_s, global_step_s, batch_stats_s, overhead}: the
    step with BatchNorm over each rank's share against over the global batch. The sums sit on
    the training thread's critical path while buckets reduce beside it (MPI_THREAD_MULTIPLE):
    forward grows by its sums, and backward finalizes every layer after a BatchNorm later by
    that layer's sum, so the plan is priced at those later ready times. (Where MPI serializes
    threads a sum also waits for the buckets handed off before it: not modelled.)"""
    rows = []
    for n in nodes:
        local = predict_step(prof, link, n, mode, bucket_bytes=bucket_bytes)
        forward, backward, per_layer = batchnorm_sums_s(prof, link, n)
        delay = np.zeros(len(prof["ready_s"]))
        for (index, _), seconds in zip(prof["batchnorm"], per_layer):
            delay[index:] += seconds
        later = dict(prof, forward_s=prof["forward_s"] + forward,
                     backward_s=prof["backward_s"] + backward,
                     ready_s=list(np.asarray(prof["ready_s"]) + delay))
        globl = predict_step(later, link, n, mode, bucket_bytes=bucket_bytes)
        rows.append({"model": prof["model"], "nodes": n, "mode": mode,
                     "local_step_s": local["step_s"], "global_step_s": globl["step_s"],
                     "batch_stats_s": forward + backward,
                     "overhead": globl["step_s"] / local["step_s"] - 1})
    return rows


def predict_run(run, link, profiles, cores=None, bucket_bytes=BUCKET_BYTES):
    """Predicted {step_s, exposed_s, slowdown, ...} of one emulated-cluster training run
    (a dict with model, hosts, ranks_per_host (default 1), rate_gbit, sync), or None when
    `profiles` has no profile of its model. See validate() for the arguments."""
    prof = profiles.get(run["model"])
    if prof is None:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    rph = int(run.get("ranks_per_host", 1))
    the_link = link[run["rate_gbit"]] if isinstance(link, dict) else link
    slowdown = compute_slowdown(run["hosts"] * rph, cores)
    # Reductions run on the same oversubscribed cores as the compute.
    slowed = costmodel.LinkModel(the_link.alpha, the_link.beta, the_link.gamma * slowdown)
    # All emulated hosts share this machine's cores: with a rank per core or more, nothing
    # is left to overlap communication with (predict_step's overlap=False).
    got = predict_step(prof, slowed, run["hosts"], run["sync"], rph, slowdown, bucket_bytes,
                       overlap=run["hosts"] * rph < cores)
    return {"model": run["model"], "hosts": run["hosts"], "ranks_per_host": rph,
            "rate_gbit": run["rate_gbit"], "sync": run["sync"], "slowdown": slowdown,
            "predicted_step_s": got["step_s"], "predicted_exposed_s": got["exposed_s"]}


def validate(measured_records, link, profiles, cores=None, bucket_bytes=BUCKET_BYTES):
    """Predicted against measured step time of emulated-cluster training runs.

    measured_records: dicts like {"model": "alexnet-cifar", "hosts": 2, "ranks_per_host": 1,
    "rate_gbit": 10, "sync": "buckets", "step_s": ..., "comm_exposed_s": ...}.
    link: a LinkModel, or a mapping rate_gbit -> LinkModel. profiles: model -> profile taken
    with the runs' threads per rank (1). cores: the cores all emulated hosts share (default:
    this process's). Records whose model has no profile are skipped. Returns one row per
    record: predicted_step_s, measured_step_s, rel_error = (predicted - measured) / measured,
    the exposed figures, slowdown and within_tolerance (|rel_error| <= TOLERANCE)."""
    rows = []
    for rec in measured_records:
        row = predict_run(rec, link, profiles, cores, bucket_bytes)
        if row is None:
            continue
        measured = float(rec["step_s"])
        error = (row["predicted_step_s"] - measured) / measured
        rows.append({**row, "measured_step_s": measured, "rel_error": error,
                     "measured_exposed_s": rec.get("comm_exposed_s"),
                     "within_tolerance": abs(error) <= TOLERANCE})
    return rows


# -- measurements on disk ------------------------------------------------------------------


def _load(name):
    path = os.path.join(harness.RESULTS_DIR, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _records(doc):
    if not isinstance(doc, dict):
        return []
    return [r for key in ("records", "runs") for r in doc.get(key) or [] if isinstance(r, dict)]


def cluster_probes():
    """The cluster suite's MPI_Allreduce probe records (perf/results/cluster.json)."""
    return [r for r in _records(_load("cluster.json")) if r.get("case") == "allreduce"]


def measured_training_records():
    """Emulated-cluster training records from any perf/results/cluster*.json: those with
    model, hosts, sync and step_s (rate_gbit derived from configured_bit_s or a "10gbit"-style
    rate when absent)."""
    found = []
    for path in sorted(glob.glob(os.path.join(harness.RESULTS_DIR, "cluster*.json"))):
        for r in _records(_load(os.path.basename(path))):
            if not all(r.get(k) for k in ("model", "hosts", "sync", "step_s")):
                continue     # (PyTorch DDP's records have no sync mode to predict)
            r = dict(r)
            if "rate_gbit" not in r:
                if "configured_bit_s" in r:
                    r["rate_gbit"] = r["configured_bit_s"] / 1e9
                elif isinstance(r.get("rate"), str) and r["rate"].endswith("gbit"):
                    r["rate_gbit"] = float(r["rate"][:-4])
                else:
                    continue
            found.append(r)
    return found


# -- the suite -----------------------------------------------------------------------------


def _ms(seconds):
    return f"{1e3 * seconds:.2f}"


def full_table(rows):
    return harness.format_table(
        ["link", "model", "mode", "nodes", "predicted step ms", "exposed comm ms",
         "efficiency", "buckets"],
        [[r["link"], r["model"], r["mode"], r["nodes"], _ms(r["step_s"]), _ms(r["exposed_s"]),
          f"{100 * r['efficiency']:.1f}%", r["buckets"]] for r in rows])


def summary_table(rows, nodes=512):
    """Efficiency at `nodes` nodes: one row per (link, model), one column per mode."""
    at = {(r["link"], r["model"], r["mode"]): r for r in rows if r["nodes"] == nodes}
    one = {(r["link"], r["model"]): r["step_s"] for r in rows if r["nodes"] == 1}
    keys = list(dict.fromkeys((r["link"], r["model"]) for r in rows))   # first-seen order
    return harness.format_table(
        ["link", "model", "1-node step ms"] + [f"{m} @{nodes}" for m in SYNC_MODES]
        + [f"dynamic exposed ms @{nodes}"],
        [[link, model, _ms(one[(link, model)])]
         + [f"{100 * at[(link, model, m)]['efficiency']:.1f}%" for m in SYNC_MODES]
         + [_ms(at[(link, model, "dynamic")]["exposed_s"])] for link, model in keys])


def validation_table(rows):
    return harness.format_table(
        ["model", "hosts x ranks", "Gbit/s", "sync", "compute x", "predicted step ms",
         "measured step ms", "error", f"within {TOLERANCE:.0%}", "predicted exposed ms",
         "measured exposed ms"],
        [[r["model"], f"{r['hosts']} x {r['ranks_per_host']}", f"{r['rate_gbit']:g}", r["sync"],
          f"{r['slowdown']:.2f}", _ms(r["predicted_step_s"]),
          "-" if r.get("measured_step_s") is None else _ms(r["measured_step_s"]),
          "-" if r.get("rel_error") is None else f"{100 * r['rel_error']:+.1f}%",
          "-" if r.get("rel_error") is None else ("yes" if r["within_tolerance"] else "NO"),
          _ms(r["predicted_exposed_s"]),
          "-" if r.get("measured_exposed_s") is None else _ms(r["measured_exposed_s"])]
         for r in rows])


def _link_json(link, **info):
    return {"alpha_s": link.alpha, "beta_s_per_byte": link.beta,
            "gamma_s_per_byte": link.gamma, **info}


def run(quick=False):
    cores = len(os.sched_getaffinity(0))
    steps, warmup = (5, 2) if quick else (20, WARMUP)
    gamma, gamma_samples = measure_gamma(repeats=3 if quick else 7)
    print(f"γ = {gamma * 1e12:.1f} ps/byte (numpy a += b, 64 MB float32, 1 thread)")

    links, notes = {}, []
    allreduce_doc = _load("allreduce.json")
    samples = loopback_samples(_records(allreduce_doc))
    loop_link = None
    try:
        loop_link = costmodel.fit_link(samples)
        if not loop_link.beta > 0:
            # Shared memory moves bytes at memory speed: the fit may put it all in γ, which
            # would predict unbounded network bandwidth at scale.
            raise ValueError(f"the fit found no per-byte wire cost ({loop_link})")
        links["loopback-fit"] = (loop_link, {"source": f"fit_link over {len(samples)} "
                                                       f"loopback allreduce-suite records"})
    except ValueError as exc:
        loop_link = None
        notes.append(f"loopback-fit: skipped ({exc}; run python -m perf allreduce)")
    probes = cluster_probes()
    cluster_records = _records(_load("cluster.json"))
    emulated = loopback_samples(cluster_records, f"@ {VALIDATION_GBIT:g}gbit")
    emu, emu_info = emulated_fit(VALIDATION_GBIT, gamma,
                                 fallback_alpha=loop_link.alpha if loop_link else 5e-6)
    links["emulated-fit"] = (emu, emu_info)
    if not probes and not emulated:
        notes.append("emulated-fit: perf/results/cluster.json has no MPI_Allreduce probes; "
                     "using the configured rate (run python -m perf cluster)")
    links[PRIMARY_LINK] = (tianhe3_link(gamma), {"source": "α = 1.5 µs, β = 1/(100 Gbit/s), "
                                                           "γ measured"})
    for name, (link, info) in links.items():
        print(f"link {name}: α = {link.alpha * 1e6:.2f} µs, β = {link.beta * 1e12:.1f} ps/B "
              f"({8 / link.beta / 1e9:.1f} Gbit/s), γ = {link.gamma * 1e12:.1f} ps/B "
              f"[{info['source']}]")
    for note in notes:
        print("note: " + note)

    profiles = {}
    for name, variant in MODELS:
        prof = profile(name, variant, threads=cores, steps=steps, warmup=warmup)
        profiles[prof["model"]] = prof
        print(f"profiled {prof['model']} ({cores} threads, batch {PER_RANK_BATCH}): forward "
              f"{_ms(prof['forward_s'])} ms, backward {_ms(prof['backward_s'])} ms, update "
              f"{_ms(prof['update_s'])} ms, {len(prof['layers'])} layers, "
              f"{sum(prof['sizes_bytes']) / 2 ** 20:.1f} MB of gradient", flush=True)
        if spread(prof) > NOISY:
            notes.append(f"profile of {prof['model']} is noisy (slowest/fastest step "
                         f"{spread(prof):.2f}): other work shared the cores; rerun idle")
            print("note: " + notes[-1])

    rows = []
    for link_name, (link, _) in links.items():
        for prof in profiles.values():
            rows += [{"link": link_name, **r} for r in predict(prof, link)]

    # Validation: the emulated runs' own setting (1 thread per rank, shared cores).
    name, variant = VALIDATION_MODEL.split("-")
    val_prof = profile(name, variant, threads=1, steps=steps, warmup=warmup)
    if spread(val_prof) > NOISY:
        notes.append(f"validation profile is noisy (slowest/fastest step "
                     f"{spread(val_prof):.2f}); rerun idle")
        print("note: " + notes[-1])
    measured = [r for r in measured_training_records() if r["model"] == VALIDATION_MODEL]
    val_links = {VALIDATION_GBIT: emu}
    for rate in {r["rate_gbit"] for r in measured} - {VALIDATION_GBIT}:
        val_links[rate] = emulated_fit(rate)[0]
    if measured:
        val_rows = validate(measured, val_links, {VALIDATION_MODEL: val_prof}, cores)
        status = (f"validation: {len(val_rows)} emulated-cluster runs; "
                  f"{sum(r['within_tolerance'] for r in val_rows)} within {TOLERANCE:.0%}")
    else:
        # Predictions for the runs still to be measured, so they can be compared later.
        val_rows = [dict(predict_run({"model": VALIDATION_MODEL, "hosts": h, "sync": m,
                                      "rate_gbit": VALIDATION_GBIT}, val_links,
                                     {VALIDATION_MODEL: val_prof}, cores),
                         measured_step_s=None, rel_error=None, within_tolerance=None,
                         measured_exposed_s=None)
                    for h in VALIDATION_HOSTS for m in SYNC_MODES]
        status = NO_MEASUREMENTS

    full = full_table([r for r in rows if r["link"] == PRIMARY_LINK])
    summary = summary_table(rows)
    val_text = validation_table(val_rows)
    print(f"\n### {PRIMARY_LINK}: predicted step, exposed communication, weak-scaling "
          f"efficiency ({PER_RANK_BATCH} images per node)\n")
    print(full)
    print("\n### scaling efficiency at 512 nodes, every link model\n")
    print(summary)
    print(f"\n### validation against the emulated cluster ({VALIDATION_MODEL}, "
          f"{VALIDATION_GBIT} Gbit/s, 1 thread per rank on {cores} shared cores)\n")
    print(status)
    print(val_text)

    panels = {}
    for r in rows:
        panels.setdefault(f"{r['model']}, {r['link']}", {}).setdefault(r["mode"], []).append(
            (r["nodes"], r["efficiency"]))
    # Model-major, link-minor: line_panels draws 3 columns, so each row is one model.
    order = [f"{m}, {link}" for m in profiles for link in links]
    png = plots.line_panels("scale", {k: panels[k] for k in order}, xlabel="nodes",
                            ylabel="weak-scaling efficiency", logx=2)
    table = (f"{summary}\n\n{status}\n\n{val_text}")
    path = harness.write_result("scale", {
        "quick": quick, "cores": cores, "per_rank_batch": PER_RANK_BATCH,
        "bucket_bytes": BUCKET_BYTES, "nodes": NODES, "modes": list(SYNC_MODES),
        "gamma": {"gamma_s_per_byte": gamma, "method": "numpy a += b, 64 MB float32, "
                  "1 thread, median seconds / 64 MB", "samples_s": gamma_samples},
        "links": {n: _link_json(link, **info) for n, (link, info) in links.items()},
        "notes": notes, "profiles": profiles, "validation_profile": val_prof,
        "predictions": rows,
        "validation": {"status": status, "tolerance": TOLERANCE, "rows": val_rows,
                       "links": {str(k): _link_json(v) for k, v in val_links.items()}},
        "table": table, "full_table": full, "plot": png})
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return rows
