"""The Dynamic Allreduce planner: optimal bucketing and algorithms (against hand arithmetic
and brute force), determinism, validation, and the fixed modes' predictions."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar.dist import planner
from dynar.dist.costmodel import ALGORITHMS, AlgorithmCost, CostModel, LinkModel
from dynar.dist.planner import Bucket, Plan


def model(**costs):
    """A CostModel with the given {algorithm: (alpha, beta)} (ranks do not matter here)."""
    return CostModel(2, 1, {a: AlgorithmCost(*ab) for a, ab in costs.items()})


def spaced(n, gap):
    return np.arange(n) * gap


def test_negligible_latency_gives_one_bucket_per_layer():
    # Each layer's allreduce (1 µs) ends long before the next layer is ready (1 ms): starting
    # every layer at once only ever helps.
    cost = model(ring=(1e-12, 1e-9))
    p = planner.plan([1000] * 6, spaced(6, 1e-3), cost)
    assert [(b.first, b.stop) for b in p.buckets] == [(i, i + 1) for i in range(6)]
    assert p.predicted_exposed_s == pytest.approx(1e-12 + 1e-6)


def test_huge_latency_gives_one_bucket():
    cost = model(ring=(1.0, 1e-9))
    p = planner.plan([1000] * 6, spaced(6, 1e-3), cost)
    assert p.buckets == (Bucket(0, 6, "ring"),)
    assert p.predicted_exposed_s == pytest.approx(1.0 + 6e-6)


def test_nothing_to_hide_behind_gives_one_bucket():
    # All gradients ready at once: splitting only adds start-ups.
    cost = model(ring=(1e-5, 1e-9))
    sizes = [4000, 10 ** 6, 12, 8 * 10 ** 6]
    p = planner.plan(sizes, np.zeros(4), cost)
    assert p.buckets == (Bucket(0, 4, "ring"),)
    assert p.predicted_exposed_s == pytest.approx(1e-5 + 1e-9 * sum(sizes))


def test_hand_computed_three_layers():
    # recursive_doubling: t(n) = 0.5 + n      ring: t(n) = 2 + n/4   (all dyadic: exact)
    # sizes [1, 4, 4], ready [0, 1, 2]. Candidate plans (best algorithm per bucket):
    #   {0}{1}{2}: rd 0 -> 1.5; ring max(1, 1.5) + 3 = 4.5; ring max(2, 4.5) + 3 = 7.5
    #   {0,1}{2}:  ring 1 + 3.25 = 4.25; ring max(2, 4.25) + 3 = 7.25
    #   {0}{1,2}:  rd 0 -> 1.5; ring max(2, 1.5) + 4 = 6     (rd for {0} is needed: ring
    #              would end {0} at 2.25 and push {1,2} to 6.25)
    #   {0,1,2}:   ring 2 + 4.25 = 6.25
    # Best: {0} by recursive doubling, {1,2} by ring, finish 6, exposed 6 - 2 = 4.
    cost = model(recursive_doubling=(0.5, 1.0), ring=(2.0, 0.25))
    p = planner.plan([1, 4, 4], [0, 1, 2], cost)
    assert p.buckets == (Bucket(0, 1, "recursive_doubling"), Bucket(1, 3, "ring"))
    assert p.predicted_finish_s == 6.0
    assert p.predicted_exposed_s == 4.0
    finish, exposed = planner.simulate(p.buckets, [1, 4, 4], [0, 1, 2], cost)
    assert finish.tolist() == [1.5, 6.0] and exposed == 4.0
    assert p.to_json() == {"buckets": [{"first": 0, "stop": 1, "algorithm": "recursive_doubling"},
                                       {"first": 1, "stop": 3, "algorithm": "ring"}],
                           "predicted_finish_s": 6.0, "predicted_exposed_s": 4.0}


def test_small_buckets_take_low_latency_big_ones_low_bandwidth():
    cost = model(recursive_doubling=(1e-6, 1e-9), ring=(1e-4, 1e-10))
    p = planner.plan([100, 100, 100, 10 ** 8], spaced(4, 1e-3), cost)
    assert [(b.first, b.stop, b.algorithm) for b in p.buckets] == [
        (0, 1, "recursive_doubling"), (1, 2, "recursive_doubling"),
        (2, 3, "recursive_doubling"), (3, 4, "ring")]
    # Restricting the choice is honoured.
    only = planner.plan([100, 100, 100, 10 ** 8], spaced(4, 1e-3), cost, algorithms=["ring"])
    assert {b.algorithm for b in only.buckets} == {"ring"}


def test_plan_is_a_pure_function_of_its_inputs(rng):
    cost = CostModel.default(16, 4)
    sizes = rng.integers(0, 4 * 10 ** 6, 60) * 4
    gaps = rng.uniform(0, 2e-3, 60)
    # Each rank measures its own timings; sync.py agrees on their elementwise maximum, in
    # whatever order the reduction combines ranks. Any order must give the same plan.
    measured = [np.cumsum(gaps + rng.uniform(0, 1e-4, 60)) for _ in range(4)]
    agreed = [np.maximum.reduce(measured), np.maximum.reduce(measured[::-1])]
    sizes_before, agreed_before = sizes.copy(), agreed[0].copy()
    plans = [planner.plan(sizes, t, cost) for t in agreed]
    plans.append(planner.plan(sizes.tolist(), agreed[0].tolist(), cost))
    plans.append(planner.plan(sizes, agreed[0], cost))
    assert all(p == plans[0] for p in plans)
    assert all(p.to_json() == plans[0].to_json() for p in plans)
    assert np.array_equal(sizes, sizes_before) and np.array_equal(agreed[0], agreed_before)


def test_empty_and_zero_size_layers():
    cost = model(ring=(1e-5, 1e-9))
    assert planner.plan([], [], cost) == Plan((), 0.0, 0.0)
    finish, exposed = planner.simulate((), [], [], cost)
    assert len(finish) == 0 and exposed == 0.0
    # Nothing to send: one (free) bucket, nothing exposed.
    assert planner.plan([0, 0, 0], [0, 1, 2], cost) == Plan((Bucket(0, 3, "ring"),), 2.0, 0.0)
    # A trailing empty layer ready late must not delay the real data: it gets its own
    # zero-byte bucket, and the data before it is hidden.
    p = planner.plan([1000, 0], [0, 1.0], cost)
    assert p.buckets == (Bucket(0, 1, "ring"), Bucket(1, 2, "ring"))
    assert p.predicted_exposed_s == 0.0


@pytest.mark.parametrize("sizes, ready, message", [
    ([1, 2], [0.0], "sizes_bytes has 2 layers but ready_s has 1"),
    ([1, -2], [0.0, 1.0], "nonnegative whole byte counts"),
    ([1, 2.5], [0.0, 1.0], "nonnegative whole byte counts"),
    ([1, 2], [1.0, 0.5], r"nondecreasing .* ready_s\[1\] < ready_s\[0\]"),
    ([1, 2], [-1.0, 0.5], "finite and nonnegative"),
    ([1, 2], [0.0, np.nan], "finite and nonnegative"),
    ([[1, 2]], [[0.0, 1.0]], "1-D"),
])
def test_invalid_layers_are_rejected(sizes, ready, message):
    cost = model(ring=(1e-5, 1e-9))
    with pytest.raises(ValueError, match=message):
        planner.plan(sizes, ready, cost)
    with pytest.raises(ValueError, match=message):
        planner.fixed_plan(sizes, ready, cost, "buckets")


def test_invalid_algorithms_and_buckets_are_rejected():
    cost = model(ring=(1e-5, 1e-9))
    with pytest.raises(ValueError, match=r"\['mpi'\] are not in the cost model"):
        planner.plan([1], [0.0], cost, algorithms=["mpi"])
    with pytest.raises(ValueError, match="no algorithms"):
        planner.plan([1], [0.0], cost, algorithms=[])
    with pytest.raises(ValueError, match="tile"):
        planner.simulate((Bucket(0, 1, "ring"), Bucket(2, 3, "ring")), [1, 1, 1], [0, 0, 0], cost)
    with pytest.raises(ValueError, match="cover layers 0..1, but there are 3"):
        planner.simulate((Bucket(0, 2, "ring"),), [1, 1, 1], [0, 0, 0], cost)


def brute_force_finish(sizes, ready, cost):
    """Earliest finish over every bucketing and every algorithm per bucket."""
    n, best = len(sizes), np.inf
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        runs = list(zip(bounds[:-1], bounds[1:]))
        for algs in itertools.product(cost.algorithms, repeat=len(runs)):
            buckets = tuple(Bucket(a, b, alg) for (a, b), alg in zip(runs, algs))
            best = min(best, planner.simulate(buckets, sizes, ready, cost)[0][-1])
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), min_size=1, max_size=7),
       st.tuples(st.integers(0, 2000), st.integers(1, 100)),
       st.tuples(st.integers(0, 2000), st.integers(1, 100)))
def test_plan_is_optimal_against_brute_force(layers, costs_a, costs_b):
    # Layers as (bytes, µs of backward before it); algorithms as (α µs, β ps/B).
    sizes = [s for s, _ in layers]
    ready = np.cumsum([g for _, g in layers]) * 1e-6
    cost = model(recursive_doubling=(costs_a[0] * 1e-6, costs_a[1] * 1e-12),
                 ring=(costs_b[0] * 1e-6, costs_b[1] * 1e-12))
    p = planner.plan(sizes, ready, cost)
    finish, exposed = planner.simulate(p.buckets, sizes, ready, cost)
    assert finish[-1] == pytest.approx(p.predicted_finish_s, rel=1e-12, abs=1e-15)
    assert exposed == pytest.approx(p.predicted_exposed_s, rel=1e-12, abs=1e-15)
    assert exposed >= 0
    assert p.predicted_finish_s <= brute_force_finish(sizes, ready, cost) * (1 + 1e-12) + 1e-15


def test_plans_a_resnet50_sized_model(rng):
    # ~160 layers, all five algorithms: must just work (speed is measured in perf/).
    sizes = rng.integers(64, 2 * 10 ** 6, 161) * 4
    ready = np.cumsum(rng.uniform(0, 1e-3, 161))
    cost = CostModel.from_link(LinkModel(5e-6, 1e-10, 5e-11), 64, 16)
    p = planner.plan(sizes, ready, cost)
    assert p.buckets[0].first == 0 and p.buckets[-1].stop == 161
    assert {b.algorithm for b in p.buckets} <= set(ALGORITHMS)
    assert planner.simulate(p.buckets, sizes, ready, cost)[1] == pytest.approx(
        p.predicted_exposed_s, rel=1e-12)


def test_static_buckets_close_at_the_first_layer_reaching_the_size(rng):
    for _ in range(20):
        sizes = rng.integers(0, 3000, rng.integers(1, 30)) * 4
        bucket_bytes = int(rng.integers(1000, 40000))
        buckets = planner.static_buckets(sizes, "buckets", bucket_bytes)
        assert buckets[0].first == 0 and buckets[-1].stop == len(sizes)
        for b, after in zip(buckets, buckets[1:]):
            assert b.stop == after.first
            total = int(sizes[b.first:b.stop].sum())
            # Full, and not full one layer earlier: the bucket closed as soon as it could.
            assert total >= bucket_bytes > total - int(sizes[b.stop - 1])
        assert sizes[buckets[-1].first:].sum() >= 0
        assert {b.algorithm for b in buckets} == {"mpi"}
    assert planner.static_buckets([4, 4], "per-layer") == (Bucket(0, 1, "mpi"), Bucket(1, 2, "mpi"))
    assert planner.static_buckets([4, 4], "fused", algorithm="ring") == (Bucket(0, 2, "ring"),)
    with pytest.raises(ValueError, match="bucket_bytes"):
        planner.static_buckets([4], "buckets", 0)


def test_fixed_plans_and_their_predictions():
    cost = model(mpi=(1e-3, 1e-6), ring=(2e-3, 1e-7))
    sizes, ready = [400, 400, 400, 1200, 200], [0.0, 0.01, 0.02, 0.03, 0.04]
    t = lambda n: 1e-3 + 1e-6 * n   # noqa: E731 - the "mpi" cost above
    # per-layer blocks backward on every allreduce: all of it is exposed.
    per_layer = planner.fixed_plan(sizes, ready, cost, "per-layer")
    assert len(per_layer.buckets) == 5
    assert per_layer.predicted_exposed_s == pytest.approx(sum(t(n) for n in sizes))
    assert per_layer.predicted_finish_s == pytest.approx(0.04 + sum(t(n) for n in sizes))
    # fused: one allreduce after backward.
    fused = planner.fixed_plan(sizes, ready, cost, "fused", algorithm="ring")
    assert fused.buckets == (Bucket(0, 5, "ring"),)
    assert fused.predicted_exposed_s == pytest.approx(2e-3 + 1e-7 * 2600)
    # buckets of 1000 B: [0,3) closes at 1200 B, [3,4) at 1200 B, [4,5) is the rest; the
    # first two finish long before backward ends, so only the last is exposed.
    buckets = planner.fixed_plan(sizes, ready, cost, "buckets", bucket_bytes=1000)
    assert [(b.first, b.stop) for b in buckets.buckets] == [(0, 3), (3, 4), (4, 5)]
    assert buckets.predicted_exposed_s == pytest.approx(t(200))
    # Overlapped modes' figures are those evaluate() gives their buckets.
    for fixed in (fused, buckets):
        assert planner.evaluate(fixed.buckets, sizes, ready, cost) == fixed


def test_fixed_modes_with_trailing_empty_layer():
    # buckets: sync.py hands the data off when layer 0 is final; the empty layer after it
    # sends nothing, so backward's end (ready 1.0) hides the whole allreduce.
    cost = model(mpi=(1e-3, 1e-6))
    p = planner.fixed_plan([4000, 0], [0.0, 1.0], cost, "buckets", bucket_bytes=100)
    assert p.buckets == (Bucket(0, 1, "mpi"), Bucket(1, 2, "mpi"))
    assert p.predicted_exposed_s == 0.0
    # fused waits for the end of backward whatever the last layers hold.
    fused = planner.fixed_plan([4000, 0], [0.0, 1.0], cost, "fused")
    assert fused.buckets == (Bucket(0, 2, "mpi"),)
    assert fused.predicted_exposed_s == pytest.approx(1e-3 + 4e-3)


def test_dynamic_never_predicts_worse_than_a_fixed_mode(rng):
    cost = CostModel.default(32, 8)
    for _ in range(20):
        n = int(rng.integers(1, 40))
        sizes = rng.integers(0, 10 ** 6, n) * 4
        ready = np.cumsum(rng.uniform(0, 2e-3, n))
        dynamic = planner.plan(sizes, ready, cost).predicted_exposed_s
        for mode in ("per-layer", "fused", "buckets"):
            for algorithm in ALGORITHMS:
                fixed = planner.fixed_plan(sizes, ready, cost, mode, bucket_bytes=2 ** 20,
                                           algorithm=algorithm).predicted_exposed_s
                assert dynamic <= fixed * (1 + 1e-12)


def test_fixed_plan_rejects_unknown_modes():
    cost = model(mpi=(1e-3, 1e-6))
    with pytest.raises(ValueError, match="unknown sync mode 'dynamic'"):
        planner.fixed_plan([1], [0.0], cost, "dynamic")
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        planner.fixed_plan([1], [0.0], cost, "buckets", bucket_bytes=0)


def test_should_replan():
    assert not planner.should_replan(1.0, 1.1, 0.2)
    assert planner.should_replan(1.0, 1.3, 0.2)
    assert planner.should_replan(1.0, 0.7, 0.2)
    assert not planner.should_replan(1.0, 1.3, 0.5)
    assert not planner.should_replan(0.0, 0.0, 0.2)
    assert planner.should_replan(0.0, 1e-9, 0.2)
    with pytest.raises(ValueError, match="threshold"):
        planner.should_replan(1.0, 1.0, threshold=0)
