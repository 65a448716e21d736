"""Dynamic Allreduce's planner: where to cut the gradient into buckets, and which allreduce
algorithm reduces each bucket, so that the communication left after backward is smallest.

The execution being planned (docs/DESIGN.md, "A step across ranks"): backward finalizes
layers 0, 1, ..., L-1 in that order, layer i at ready_s[i]; a bucket is a contiguous run of
whole layers; one communication thread reduces the buckets one after another, bucket k starting at
max(ready time of its last layer, finish of bucket k-1) and taking cost.time(alg_k, bytes_k).
What the step pays is the *exposed* time: finish of the last bucket minus ready_s[L-1].

`plan()` finds the optimum exactly by dynamic programming over layer prefixes; `evaluate()`
gives any bucket list the same figures (the online trials' baselines), and `fixed_plan()`
those of sync.py's fixed modes as they run (perf/scale.py's predictions). Everything here
is a pure function of its inputs: every rank passes the same (allgathered) timings and gets
the same plan, which keeps the sequence of collectives identical on all ranks.
"""
from dataclasses import dataclass

import numpy as np

# sync.py's fixed modes (its baselines); "dynamic" is what plan() computes.
MODES = ("per-layer", "fused", "buckets")
# The "buckets" mode's bucket size unless told otherwise (--bucket-mb): PyTorch DDP's
# bucket_cap_mb.
DEFAULT_BUCKET_MB = 25.0
DEFAULT_BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2 ** 20)


@dataclass(frozen=True)
class Bucket:
    """Layers first..stop-1 (in ready order), reduced together with `algorithm`."""
    first: int
    stop: int
    algorithm: str


@dataclass(frozen=True)
class Plan:
    """Buckets tiling the layers in order, with the predicted finish of the last bucket
    (seconds, on ready_s's clock) and the exposed communication (seconds after backward)."""
    buckets: tuple
    predicted_finish_s: float
    predicted_exposed_s: float

    def to_json(self):
        """A plain json-serializable dict."""
        return {"buckets": [{"first": b.first, "stop": b.stop, "algorithm": b.algorithm}
                            for b in self.buckets],
                "predicted_finish_s": self.predicted_finish_s,
                "predicted_exposed_s": self.predicted_exposed_s}


def _layers(sizes_bytes, ready_s):
    """sizes as int64 and ready times as float64 arrays, after checking they describe a
    backward pass: equal lengths, byte counts nonnegative integers, times finite,
    nonnegative and nondecreasing."""
    sizes = np.asarray(sizes_bytes)
    ready = np.asarray(ready_s, dtype=np.float64)
    if sizes.ndim != 1 or ready.ndim != 1:
        raise ValueError(f"sizes_bytes and ready_s must be 1-D, got shapes {sizes.shape} "
                         f"and {ready.shape}")
    if len(sizes) != len(ready):
        raise ValueError(f"sizes_bytes has {len(sizes)} layers but ready_s has {len(ready)}")
    if len(sizes) and (sizes.dtype.kind not in "iuf" or np.any(sizes < 0)
                       or np.any(sizes != np.floor(sizes))):
        raise ValueError("sizes_bytes must be nonnegative whole byte counts")
    if not np.all(np.isfinite(ready)) or np.any(ready < 0):
        raise ValueError("ready_s must be finite and nonnegative")
    if np.any(np.diff(ready) < 0):
        first = int(np.argmax(np.diff(ready) < 0))
        raise ValueError(f"ready_s must be nondecreasing (layers finalize in order), but "
                         f"ready_s[{first + 1}] < ready_s[{first}]")
    return sizes.astype(np.int64), ready


def _algorithms(cost, algorithms):
    available = tuple(cost.algorithms)
    if algorithms is None:
        algorithms = available
    algorithms = tuple(algorithms)
    if not algorithms:
        raise ValueError("no algorithms to plan with")
    missing = [a for a in algorithms if a not in available]
    if missing:
        raise ValueError(f"algorithms {missing} are not in the cost model "
                         f"(has {', '.join(available)})")
    return algorithms


def plan(sizes_bytes, ready_s, cost, algorithms=None):
    """The bucketing and per-bucket algorithms that finish communication earliest.

    sizes_bytes[i], ready_s[i]: layer i's gradient bytes and the time (s, since the first
    layer was ready) backward finalizes it. cost: anything with `.algorithms` and
    `.time(algorithm, nbytes)` accepting a numpy array of byte counts (CostModel does).
    algorithms: the subset of cost.algorithms to choose from (default all).

    Among equally fast plans it prefers, at each step of the recursion, the larger last
    bucket (fewer, bigger collectives), then the algorithm listed first: the result is a
    deterministic function of the inputs. Zero layers give a Plan with no buckets."""
    sizes, ready = _layers(sizes_bytes, ready_s)
    algorithms = _algorithms(cost, algorithms)
    n = len(sizes)
    if n == 0:
        return Plan((), 0.0, 0.0)

    # run_cost[a, i, j]: seconds for algorithm a to reduce layers i..j-1 (i < j), priced in
    # one call per algorithm.
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    first, stop = np.triu_indices(n + 1, 1)
    run_bytes = offsets[stop] - offsets[first]
    run_cost = np.zeros((len(algorithms), n + 1, n + 1))
    for a, algorithm in enumerate(algorithms):
        t = np.asarray(cost.time(algorithm, run_bytes), dtype=np.float64)
        if t.shape != run_bytes.shape:
            raise TypeError(f"cost.time({algorithm!r}, nbytes) must price an array of byte "
                            f"counts elementwise; got shape {t.shape} for {run_bytes.shape}")
        run_cost[a, first, stop] = t

    # best[j]: earliest finish of a plan covering layers 0..j-1. The last bucket i..j-1
    # starts at max(ready[j-1], best[i]), which never decreases as best[i] grows, so the
    # earliest-finishing plan of each prefix is the best one to extend: prefix optima give
    # the global optimum. best[0] = -inf: before the first bucket nothing holds it back.
    best = np.full(n + 1, -np.inf)
    cut = np.zeros(n + 1, dtype=np.int64)
    pick = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        start = np.maximum(ready[j - 1], best[:j])
        candidates = start[:, None] + run_cost[:, :j, j].T    # (first layer i, algorithm)
        # argmin returns the first minimum in row-major order: smallest i (largest last
        # bucket), then the earliest algorithm - the documented tie-breaking.
        i, a = divmod(int(np.argmin(candidates)), len(algorithms))
        best[j], cut[j], pick[j] = candidates[i, a], i, a

    buckets, j = [], n
    while j > 0:
        buckets.append(Bucket(int(cut[j]), j, algorithms[pick[j]]))
        j = int(cut[j])
    finish = float(best[n])
    return Plan(tuple(reversed(buckets)), finish, finish - float(ready[-1]))


def _check_tiling(buckets, n):
    expected = 0
    for b in buckets:
        if b.first != expected or b.stop <= b.first:
            raise ValueError(f"buckets must tile layers 0..{n - 1} in order; {b} does not "
                             f"start at layer {expected} or is empty")
        expected = b.stop
    if expected != n:
        raise ValueError(f"buckets cover layers 0..{expected - 1}, but there are {n} layers")


def simulate(buckets, sizes_bytes, ready_s, cost):
    """(finish times of the buckets, exposed seconds) when one communication thread reduces
    `buckets` in order, overlapped with backward (the execution plan() optimizes).

    Exposed = finish of the last bucket - ready_s[-1]; >= 0, since the last bucket cannot
    start before the last layer is ready. No buckets (no layers): ([], 0.0)."""
    sizes, ready = _layers(sizes_bytes, ready_s)
    _check_tiling(buckets, len(sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    finish, previous = [], -np.inf
    for b in buckets:
        seconds = float(cost.time(b.algorithm, int(offsets[b.stop] - offsets[b.first])))
        previous = max(float(ready[b.stop - 1]), previous) + seconds
        finish.append(previous)
    exposed = finish[-1] - float(ready[-1]) if finish else 0.0
    return np.array(finish), exposed


def evaluate(buckets, sizes_bytes, ready_s, cost):
    """The Plan of running `buckets` as simulate() models, with its figures."""
    finish, exposed = simulate(buckets, sizes_bytes, ready_s, cost)
    return Plan(tuple(buckets), float(finish[-1]) if len(finish) else 0.0, exposed)


def static_buckets(sizes_bytes, mode, bucket_bytes=DEFAULT_BUCKET_BYTES, algorithm="mpi"):
    """The buckets of a fixed sync mode, as layer runs all reduced with `algorithm`:
    "per-layer" one per layer, "fused" one for everything, "buckets" closes a bucket at the
    first layer that brings it to bucket_bytes or more (a layer is never split: its gradient
    becomes final all at once), the remainder forming the last bucket."""
    if mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "buckets" and not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    sizes = np.asarray(sizes_bytes)
    n = len(sizes)
    if n == 0:
        return ()
    if mode == "per-layer":
        return tuple(Bucket(i, i + 1, algorithm) for i in range(n))
    if mode == "fused":
        return (Bucket(0, n, algorithm),)
    buckets, first, filled = [], 0, 0
    for i, size in enumerate(sizes):
        filled += int(size)
        if filled >= bucket_bytes:
            buckets.append(Bucket(first, i + 1, algorithm))
            first, filled = i + 1, 0
    if first < n:
        buckets.append(Bucket(first, n, algorithm))
    return tuple(buckets)


def fixed_plan(sizes_bytes, ready_s, cost, mode, bucket_bytes=DEFAULT_BUCKET_BYTES,
               algorithm="mpi"):
    """The Plan sync.py's fixed mode `mode` ("per-layer", "fused", "buckets") would run,
    every bucket reduced with `algorithm`, with predicted figures for how that mode runs:

    - per-layer blocks backward for each layer's allreduce, so all of it is exposed:
      finish = ready_s[-1] + sum of costs;
    - fused starts one allreduce after backward: exposed = its cost;
    - buckets (bucket_bytes, the rule of static_buckets) overlap as simulate() models."""
    sizes, ready = _layers(sizes_bytes, ready_s)
    buckets = static_buckets(sizes, mode, bucket_bytes, algorithm)
    if len(sizes) == 0:
        return Plan((), 0.0, 0.0)
    if mode == "per-layer":
        costs = [float(cost.time(b.algorithm, int(sizes[b.first:b.stop].sum())))
                 for b in buckets]
        exposed = float(sum(costs))
        return Plan(buckets, float(ready[-1]) + exposed, exposed)
    return evaluate(buckets, sizes, ready, cost)


def should_replan(predicted_s, measured_s, threshold):
    """True when a measurement has drifted from its prediction by more than `threshold`
    relative to the prediction: |measured - predicted| > threshold·predicted (a prediction
    of 0 drifts as soon as anything nonzero is measured)."""
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    return abs(measured_s - predicted_s) > threshold * predicted_s
