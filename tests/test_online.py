"""Dynamic Allreduce's online controller, without MPI: phases, trials, choice and drift."""
import numpy as np

from dynar.dist import online
from dynar.dist.costmodel import AlgorithmCost, CostModel

SIZES = np.array([4000, 400000, 40000, 4000000], np.int64)
READY = np.array([0.0, 0.002, 0.004, 0.006])


def cost_model():
    return CostModel(2, 1, {"mpi": AlgorithmCost(1e-5, 1e-9),
                            "ring": AlgorithmCost(3e-5, 5e-10)}), "test model"


def controller(events, agree=lambda a: a):
    return online.OnlinePlanner(SIZES, cost_model, None, agree, events.append,
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


def runs(names):
    """[(name, consecutive steps)] of a per-step list of names."""
    out = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return [tuple(r) for r in out]


def test_measures_then_tries_every_candidate_and_keeps_the_fastest():
    events = []
    ctl = controller(events)
    speed = {"default": 0.01, "planned": 0.009, "fused": 0.008, "buckets": 0.012,
             "fused (mpi)": 0.007, "buckets (mpi)": 0.011}
    ran = []
    drive(ctl, lambda name: speed[name], 120, ran)
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
    # The default plan ran MEASURE_STEPS steps, then every candidate half the steps that
    # fill TRIAL_SECONDS at the default plan's figure, and again in reverse order (the
    # middle two halves are one run); each switch adds a step that is not counted.
    half = online.trial_half_steps(speed["default"])
    order = names + names[::-1]
    expected = [("default", online.MEASURE_STEPS)] + [
        (name, half * (2 if i == len(names) - 1 else 1) + 1)
        for i, name in enumerate(order) if i != len(names)]
    assert runs(ran)[:len(expected)] == expected
    assert chosen[0]["step"] == sum(n for _, n in expected)
    assert chosen[0]["step"] <= online.exploration_steps(speed["default"], len(names))


def test_a_plan_with_more_buckets_must_win_by_more_than_the_tie_margin():
    events = []
    # "planned" (several buckets) measures 3% faster than the one bucket: within TIE, so
    # the one bucket runs; at 10% faster the planned buckets do.
    for margin, want in ((0.03, 1), (0.10, None)):
        events.clear()
        ctl = controller(events)
        speed = {"default": 0.01, "planned": 0.008 * (1 - margin), "fused": 0.0085,
                 "buckets": 0.012, "fused (mpi)": 0.008, "buckets (mpi)": 0.011}
        drive(ctl, lambda name: speed[name], 120)
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
    drive(ctl, lambda name: 0.0005, 600, ran)
    assert online.trial_steps(0.0005) == 40
    # Two halves of 20 steps per candidate, each after a switching step.
    assert runs(ran)[1:3] == [("planned", 21), ("fused", 21)]
    assert online.trial_steps(0.05) == online.TRIAL_STEPS
    assert online.trial_steps(1e-6) == online.MAX_TRIAL_STEPS
    assert online.check_steps(0.0005) == 200 and online.check_steps(0.01) == online.CHECK_STEPS


def test_drift_starts_new_trials_and_steady_timings_do_not():
    events = []
    ctl = controller(events)
    state = {"slow": 1.0}
    drive(ctl, lambda name: 0.01 * state["slow"], 45 + 3 * online.CHECK_STEPS)
    assert sum(e["phase"] == "chosen" for e in events) == 1
    state["slow"] = 1.5
    drive(ctl, lambda name: 0.01 * state["slow"], 6 * online.CHECK_STEPS)
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
    drive(ctl, lambda name: figure["now"], 6 * online.CHECK_STEPS)
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert len(chosen) == 2 and chosen[1]["reason"].startswith("drift: 18.20 ms against 14.00 ms")


def test_ranks_with_different_timings_choose_the_same_plan():
    # The agree() callback stands for the MPI max over ranks: whatever each rank measured
    # locally, both see the same figures and so walk through identical decisions.
    rng = np.random.default_rng(0)
    shared = {}

    def agree(values):
        key = (values.shape, len(shared))
        return shared.setdefault(key, values * 0 + 0.02)   # "the slowest rank's" figures

    plans = []
    for rank in range(2):
        shared.clear()
        ctl = controller([], agree)
        for _ in range(60):
            ctl.observe(np.sort(rng.random(4)) * 0.01, rng.random() * 0.01)
        plans.append(ctl.plan)
    assert plans[0] == plans[1]


def test_trials_run_dynars_own_algorithm_even_when_the_model_prices_the_library_cheapest():
    # A brief tune's prices are a guess where algorithms are close: the trials measure the
    # cheapest of dynar's own algorithms beside the library's, and keep the faster.
    def mpi_cheapest():
        return CostModel(2, 1, {"mpi": AlgorithmCost(1e-5, 4e-10),
                                "ring": AlgorithmCost(3e-5, 5e-10),
                                "rabenseifner": AlgorithmCost(2e-5, 6e-10)}), "test model"
    events = []
    ctl = online.OnlinePlanner(SIZES, mpi_cheapest, None, lambda a: a, events.append,
                               bucket_bytes=300000)
    speed = {"default": 0.01, "planned": 0.009, "fused": 0.009, "buckets": 0.012,
             "fused (dynar)": 0.007, "buckets (dynar)": 0.011}
    drive(ctl, lambda name: speed[name], 160)
    trials = {e["candidate"]: e for e in events if e["phase"] == "trial"}
    assert trials["fused"]["algorithms"] == {"mpi": 1}
    assert trials["fused (dynar)"]["algorithms"] == {"ring": 1}
    chosen = [e for e in events if e["phase"] == "chosen"]
    assert chosen[0]["candidate"] == "fused (dynar)"
    assert {b.algorithm for b in ctl.plan.buckets} == {"ring"}
    assert len(trials) <= online.MAX_CANDIDATES
