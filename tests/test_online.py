"""Dynamic Allreduce's online controller, without MPI: phases, trials, choice and drift."""
import collections
import threading

import numpy as np

from dynar.dist import online
from dynar.dist.costmodel import AlgorithmCost, CostModel

SIZES = np.array([4000, 400000, 40000, 4000000], np.int64)
READY = np.array([0.0, 0.002, 0.004, 0.006])


def cost_model():
    return CostModel(2, 1, {"mpi": AlgorithmCost(1e-5, 1e-9),
                            "ring": AlgorithmCost(3e-5, 5e-10)}), "test model"


def one_rank(values):
    return np.asarray(values)[None]


def controller(events, gather=one_rank):
    return online.OnlinePlanner(SIZES, cost_model, None, gather, events.append,
                                bucket_bytes=300000)


def drive(ctl, figure, steps, ran=None):
    """Feed `steps` steps whose sync figure is figure(candidate running); returns the
    (step, buckets) changes. ran, a list, gets the candidate of every step."""
    changes = []
    for _ in range(steps):
        name = ctl.candidate or "default"
        if ran is not None:
            ran.append(name)
        new = ctl.observe(READY, figure(name))
        if new is not None:
            changes.append((ctl.step, new))
    return changes


def test_measures_then_tries_every_candidate_and_keeps_the_fastest():
    events = []
    ctl = controller(events)
    speed = {"default": 0.01, "planned": 0.009, "fused": 0.008, "buckets": 0.012,
             "fused (mpi)": 0.007, "buckets (mpi)": 0.011}
    ran = []
    drive(ctl, lambda name: speed[name], online.exploration_steps(0.01), ran)
    phases = [e["phase"] for e in events]
    assert phases[0] == "cost model" and events[0]["source"] == "test model"
    trials = [e for e in events if e["phase"] == "trial"]
    names = [t["candidate"] for t in trials]
    # Candidates with the same buckets and algorithms are tried once.
    assert names[0] == "planned" and {"fused", "fused (mpi)"} <= set(names), names
    assert len({(t["buckets"], str(t["algorithms"]), str(t["bucket_mb"])) for t in trials}) \
        == len(trials)
    assert [t["measured_sync_s"] for t in trials] == [speed[n] for n in names]
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["candidate"] == "fused (mpi)"
    assert len(ctl.plan.buckets) == 1
    # The default plan ran MEASURE_STEPS steps, then every candidate a block (warm-up steps,
    # then half the steps that fill TRIAL_SECONDS at the default plan's figure), and again
    # in reverse order.
    steps = online.trial_steps(speed["default"])
    assert all(t["steps"] == steps for t in trials)
    expected = ["default"] * online.MEASURE_STEPS + [
        name for name, _ in online.trial_schedule(names, steps,
                                                  online.warmup_steps(speed["default"]))]
    assert ran[:len(expected)] == expected
    assert chosen[0]["step"] == len(expected)
    assert chosen[0]["step"] <= online.exploration_steps(speed["default"], len(names))


def test_trial_blocks_go_there_and_back_each_after_unmeasured_warm_up_steps():
    schedule = online.trial_schedule(["A", "B", "C"], 4, 3)
    warm, half = [False] * 3, [True] * 2
    # C's second block continues its first: nothing to warm up.
    assert [n for n, _ in schedule] == list("AAAAABBBBBCCCCCCCBBBBBAAAAA")
    assert [m for _, m in schedule] == (warm + half) * 3 + half + (warm + half) * 2


def test_a_plan_that_starts_slow_after_a_switch_is_measured_once_warm():
    # The library's allreduce after a block of the ring: its idle connections restart in
    # TCP slow start, so its first 0.1 s of steps are slow. Warm, it is the fastest.
    events = []
    ctl = controller(events)
    speed = {"default": 0.01, "planned": 0.0080, "fused": 0.0076, "buckets": 0.0090,
             "fused (mpi)": 0.0070, "buckets (mpi)": 0.0085}
    ran = []

    def figure(name):
        since_switch = next((i for i, n in enumerate(reversed(ran[:-1])) if n != name),
                            len(ran) - 1)
        cold = name == "fused (mpi)" and since_switch < 10
        return speed[name] * (1.6 if cold else 1.0)

    drive(ctl, figure, online.exploration_steps(0.01), ran)
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["candidate"] == "fused (mpi)"
    trials = {e["candidate"]: e["measured_sync_s"] for e in events if e["phase"] == "trial"}
    assert trials == {name: speed[name] for name in trials}


def test_a_candidates_figure_averages_each_step_over_ranks_before_the_median():
    # The rank that reaches the allreduce last waits least: on A the ranks take turns at
    # waiting (5 ms, 2 ms), which costs 3.5 ms a step; B costs 4 ms on both. One rank's own
    # median (5 ms on rank 0) would make A look the slower.
    names = ["A", "B"] * 4
    rank0 = [5, 4, 5, 4, 5, 4, 2, 4]
    rank1 = [2, 4, 2, 4, 2, 4, 5, 4]
    assert online.candidate_figures([rank0, rank1], names) == {"A": 3.5, "B": 4.0}


def test_a_plan_with_more_buckets_must_win_by_more_than_the_tie_margin():
    events = []
    # "planned" (several buckets) measures 3% faster than the one bucket: within TIE, so
    # the one bucket runs; at 10% faster the planned buckets do.
    for margin, want in ((0.03, 1), (0.10, None)):
        events.clear()
        ctl = controller(events)
        speed = {"default": 0.01, "planned": 0.008 * (1 - margin), "fused": 0.0085,
                 "buckets": 0.012, "fused (mpi)": 0.008, "buckets (mpi)": 0.011}
        drive(ctl, lambda name: speed[name], online.exploration_steps(0.01))
        chosen = [e for e in events if e["phase"] == "chosen"]
        assert len(chosen) == 1
        planned = [e for e in events if e["phase"] == "trial" and e["candidate"] == "planned"]
        assert planned and planned[0]["buckets"] > 1
        if want == 1:
            assert chosen[0]["candidate"] == "fused (mpi)" and chosen[0]["buckets"] == 1
        else:
            assert chosen[0]["candidate"] == "planned"


def test_trials_on_fast_steps_run_long_enough_to_tell_candidates_apart():
    # At 0.5 ms a step, TRIAL_STEPS steps are 2 ms of timing: trials stretch to fill
    # TRIAL_SECONDS instead (and drift checks CHECK_SECONDS), bounded.
    events = []
    ctl = controller(events)
    ran = []
    drive(ctl, lambda name: 0.0005, online.exploration_steps(0.0005), ran)
    assert online.trial_steps(0.0005) == online.MAX_TRIAL_STEPS
    chosen = [e for e in events if e["phase"] == "chosen"][0]["step"]
    tried = collections.Counter(ran[online.MEASURE_STEPS:chosen])
    assert online.warmup_steps(0.0005) == online.MAX_WARMUP_STEPS
    # Two blocks each (the middle one's second needs no warm-up).
    assert sorted(set(tried.values())) == [online.MAX_TRIAL_STEPS + n * online.MAX_WARMUP_STEPS
                                           for n in (1, 2)]
    assert online.trial_steps(0.05) == online.TRIAL_STEPS
    assert online.check_steps(0.0005) == 200 and online.check_steps(0.01) == online.CHECK_STEPS


def test_drift_starts_new_trials_and_steady_timings_do_not():
    events = []
    ctl = controller(events)
    state = {"slow": 1.0}
    drive(ctl, lambda name: 0.01 * state["slow"],
          online.exploration_steps(0.01) + 3 * online.CHECK_STEPS)
    assert sum(e["phase"] == "chosen" for e in events) == 1
    state["slow"] = 1.5
    drive(ctl, lambda name: 0.01 * state["slow"],
          3 * online.CHECK_STEPS + online.exploration_steps(0.015))
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert len(chosen) == 2 and chosen[1]["reason"].startswith("drift: 15.00 ms against 10.00 ms")


def test_drift_is_measured_against_the_chosen_plans_own_steady_figure():
    # The chosen plan runs 40% slower than its trial said, and stays there: no new trials.
    # Then it slows by 30% more: drift, against its steady figure.
    events = []
    ctl = controller(events)
    figure = {"now": 0.01}
    while not any(e["phase"] == "chosen" for e in events):
        drive(ctl, lambda name: figure["now"], 1)
    figure["now"] = 0.014
    drive(ctl, lambda name: figure["now"], 4 * online.CHECK_STEPS)
    steady = [e for e in events if e["phase"] == "steady"]
    assert len(steady) == 1 and steady[0]["measured_sync_s"] == 0.014
    assert sum(e["phase"] == "chosen" for e in events) == 1
    figure["now"] = 0.014 * 1.3
    drive(ctl, lambda name: figure["now"],
          3 * online.CHECK_STEPS + online.exploration_steps(figure["now"]))
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert len(chosen) == 2 and chosen[1]["reason"].startswith("drift: 18.20 ms against 14.00 ms")


def test_a_new_trial_runs_each_candidates_new_plan_even_under_the_running_name():
    # "planned" wins; then every layer is ready at once and the steps slow down: drift. The
    # new trial's first block is "planned" again, now one bucket, and must run that.
    events = []
    ctl = controller(events)
    running = {"buckets": None}

    def step(ready, figure):
        new = ctl.observe(ready, figure)
        if new is not None:
            running["buckets"] = new

    while not any(e["phase"] == "chosen" for e in events):
        step(READY, 0.005 if ctl.candidate == "planned" else 0.01)
    first = ctl.plan.buckets
    assert ctl.candidate == "planned" and running["buckets"] == first and len(first) > 1
    slow = 0
    while not ctl._schedule:
        step(np.zeros_like(READY), 0.008 if slow < 3 * online.CHECK_STEPS else 0.012)
        slow += 1
    assert ctl.candidate == "planned" and ctl.plan.buckets != first
    assert running["buckets"] == ctl.plan.buckets


class Allgather:
    """An allgather among threads, one per rank: what MPI_Allgather does for sync.py."""

    def __init__(self, ranks):
        self._barrier = threading.Barrier(ranks, timeout=10)
        self._rows = [None] * ranks

    def of(self, rank):
        def gather(values):
            self._rows[rank] = np.array(values, np.float64)
            self._barrier.wait()
            out = np.stack(self._rows)
            self._barrier.wait()        # nobody overwrites a row before every rank read it
            return out
        return gather


def test_ranks_with_different_timings_choose_the_same_plans_at_the_same_steps():
    # Each rank measures its own timings; the decisions come only from gathered figures,
    # so every rank switches to the same buckets at the same step.
    comm = Allgather(3)
    decisions = [None] * 3

    def rank(r):
        rng = np.random.default_rng(r)
        ctl, changes = controller([], comm.of(r)), []
        for _ in range(400):
            new = ctl.observe(np.sort(rng.random(4)) * 0.01, rng.random() * 0.01)
            if new is not None:
                changes.append((ctl.step, new))
        decisions[r] = changes

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert decisions[0] and decisions[0] == decisions[1] == decisions[2]


def test_trials_run_dynars_own_algorithm_even_when_the_model_prices_the_library_cheapest():
    # A brief tune's prices are a guess where algorithms are close: the trials measure the
    # cheapest of dynar's own algorithms beside the library's, and keep the faster.
    def mpi_cheapest():
        return CostModel(2, 1, {"mpi": AlgorithmCost(1e-5, 4e-10),
                                "ring": AlgorithmCost(3e-5, 5e-10),
                                "rabenseifner": AlgorithmCost(2e-5, 6e-10)}), "test model"
    events = []
    ctl = online.OnlinePlanner(SIZES, mpi_cheapest, None, one_rank, events.append,
                               bucket_bytes=300000)
    speed = {"default": 0.01, "planned": 0.009, "fused": 0.009, "buckets": 0.012,
             "fused (dynar)": 0.007, "buckets (dynar)": 0.011}
    drive(ctl, lambda name: speed[name], online.exploration_steps(0.01))
    trials = {e["candidate"]: e for e in events if e["phase"] == "trial"}
    assert trials["fused"]["algorithms"] == {"mpi": 1}
    assert trials["fused (dynar)"]["algorithms"] == {"ring": 1}
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert chosen[0]["candidate"] == "fused (dynar)"
    assert {b.algorithm for b in ctl.plan.buckets} == {"ring"}
    assert len(trials) <= online.MAX_CANDIDATES
