"""Dynamic Allreduce's online part: measure, plan, try, keep, and re-plan on drift.

The planner's model knows message costs and when backward finalizes each layer, but not
what communicating *during* backward does to backward itself: on a node whose cores all
compute, the communication thread's copies and sums take cycles from the compute threads
(on this 2-core machine AlexNet's backward runs ~30% slower while buckets reduce beside it).
So the plan the model prefers is not trusted blindly: it is tried against the two baselines
it must beat (everything after backward, and DDP-style 25 MB buckets), each with the
model's cheapest algorithm per bucket, with the MPI library's own, and with the cheapest of
dynar's own, a few steps each, and the fastest *measured* wins (a plan with more buckets
only by more than TIE). The model's prices come from a brief tune (a few timed calls per
size, up to 32 MB), so its cheapest is only a guess where algorithms are close: on 4
emulated hosts at 10 Gbit/s a brief tune priced the library's allreduce cheapest for
AlexNet's 89 MB, and with trials of that algorithm alone dynamic ran 4% behind the best
fixed mode; in launches whose tune priced one of dynar's cheapest, the trials chose it and
ran 4-7% ahead.

The phases, all decided from figures maxed over ranks so every rank switches plans at the
same step (collective sequences can never differ):

1. measure: MEASURE_STEPS steps on the default plan, recording each layer's ready time;
2. trial:   each candidate plan runs trial_steps() steps, in two halves: every candidate
            once, then again in reverse order (A B C C B A), so a trend in step times over
            the trials adds about as much to every candidate's figure (on 4 emulated hosts
            at 1 Gbit/s the plan tried first won on LeNet's steps of the first few hundred
            and then ran 5-10% slower than fused mode); a candidate's figure is the median
            over its steps of backward span + exposed communication (the part of a step
            sync can change);
3. run:     the fastest candidate. Its first check_steps() steps give its steady figure
            (event phase "steady"); every check_steps() steps after, the figure is compared
            with that, and two windows in a row drifting beyond DRIFT start a new trial from
            fresh timings. The baseline is the chosen plan's own steady figure, not the
            trial's: a trial is a short window right after a switch, and on 4 ranks sharing
            2 cores LeNet's plan won its trial at 2.18 ms, then ran at 2.9-3.2 ms on the
            same plan, and in one launch of two the check against the trial figure re-ran
            every trial mid-run.
Trials and checks last at least TRIAL_STEPS and CHECK_STEPS steps, and on fast steps as many
as fill TRIAL_SECONDS and CHECK_SECONDS: four steps of LeNet (0.8 ms each on 2 ranks) are
too few to tell its candidates apart, and picked the slower one in one of two runs; 20 ms
of trial (5-10 of its 2-4 ms steps on 4 emulated hosts) still let a 2-bucket plan win that
then ran 16% behind the fixed modes, where 100 ms (25-40 steps) chose one bucket in three
runs of three, within 1-5% of the fastest fixed mode.

Every decision is logged as a JSON event "plan" (phase trial, chosen or steady) with the
predicted and the measured figure.
"""
import collections

import numpy as np

from . import planner

MEASURE_STEPS = 6      # the first is dropped: it pays for buffer allocation
TRIAL_STEPS = 4
TRIAL_SECONDS = 0.1
MAX_TRIAL_STEPS = 40
CHECK_STEPS = 20
CHECK_SECONDS = 0.1
DRIFT = 0.2
# A plan with more buckets must beat one with fewer by this fraction of the figure to be
# chosen: within it the trials cannot tell them apart (4 ranks sharing 2 cores: LeNet's
# 3-bucket plan won its trial, then ran its steps at 3.4 ms against the one bucket's 2.3 ms),
# and each extra bucket costs a hand-off to the communication thread that the figure sees
# only as noise.
TIE = 0.05
# At most this many plans are tried: the planner's, and the two baselines with each of the
# three algorithm choices (candidates()).
MAX_CANDIDATES = 1 + 2 * 3


def _steps_filling(seconds, sync_s, least, most):
    return int(min(most, max(least, np.ceil(seconds / max(sync_s, 1e-9)))))


def trial_steps(sync_s):
    """Steps each trial runs when a step's sync figure is sync_s seconds."""
    return _steps_filling(TRIAL_SECONDS, sync_s, TRIAL_STEPS, MAX_TRIAL_STEPS)


def trial_half_steps(sync_s):
    """Steps of each of a trial's two halves (trial_steps, rounded up to an even count)."""
    return -(-trial_steps(sync_s) // 2)


def exploration_steps(sync_s, candidates=MAX_CANDIDATES):
    """At most how many steps go by before the first plan is chosen, when a step's sync
    figure is sync_s seconds: the measuring steps, then each candidate's two halves, each
    after a dropped switching step."""
    return MEASURE_STEPS + 1 + 2 * candidates * (trial_half_steps(sync_s) + 1)


def check_steps(sync_s):
    """Steps of each drift-check window when a step's sync figure is sync_s seconds."""
    return _steps_filling(CHECK_SECONDS, sync_s, CHECK_STEPS, 10 * CHECK_STEPS)


def candidates(sizes_bytes, ready_s, cost, algorithms, bucket_bytes):
    """[(name, Plan)] the trials compare: the planner's plan, and the two baselines (one
    bucket; buckets of bucket_bytes) with the cheapest algorithm per bucket, with the MPI
    library's own (the exact static modes), and with the cheapest of dynar's own: the
    model's prices are fitted, the trials measure, step by step. Plans with the same
    buckets and algorithms appear once."""
    sizes = np.asarray(sizes_bytes, np.int64)
    found = {"planned": planner.plan(sizes, ready_s, cost, algorithms)}

    def cheapest(among):
        return lambda nbytes: min(among, key=lambda a: float(cost.time(a, int(nbytes))))

    pickers = {"": cheapest(algorithms)}
    if "mpi" in algorithms:
        pickers[" (mpi)"] = lambda nbytes: "mpi"
    own = [a for a in algorithms if a != "mpi"]
    if own:
        pickers[" (dynar)"] = cheapest(own)
    for mode in ("fused", "buckets"):
        runs = planner.static_buckets(sizes, mode, bucket_bytes)
        for suffix, pick in pickers.items():
            buckets = tuple(planner.Bucket(b.first, b.stop, pick(sizes[b.first:b.stop].sum()))
                            for b in runs)
            finish, exposed = planner.simulate(buckets, sizes, ready_s, cost)
            found[mode + suffix] = planner.Plan(buckets, float(finish[-1]), exposed)
    unique = {}
    for name, plan in found.items():
        unique.setdefault(plan.buckets, (name, plan))
    return list(unique.values())


def _fastest(results):
    """The (name, plan, measured) to run: the fastest, or within TIE of it the one with the
    fewest buckets (the fastest of those)."""
    best = min(r[2] for r in results)
    close = [r for r in results if r[2] <= best * (1 + TIE)]
    return min(close, key=lambda r: (len(r[1].buckets), r[2]))


class OnlinePlanner:
    """Feeds on one step at a time (observe) and says when the buckets change.

    sizes_bytes: per-layer gradient bytes (on the wire) in ready order; cost_model(): the
    (CostModel, source), fetched on first use (collective); algorithms: those allowed
    (None: all the cost model has);
    agree(array) -> elementwise max over ranks; on_event(dict) records decisions."""

    def __init__(self, sizes_bytes, cost_model, algorithms, agree, on_event,
                 bucket_bytes=25 * 2 ** 20):
        self.sizes = np.asarray(sizes_bytes, np.int64)
        self._cost_model, self._cost = cost_model, None
        self._algorithms = algorithms
        self._agree = agree
        self._on_event = on_event
        self.bucket_bytes = bucket_bytes
        self._ready = collections.deque(maxlen=MEASURE_STEPS - 1)
        self._recent = collections.deque(maxlen=MEASURE_STEPS - 1)   # sync figures
        self._half_steps = self._check_steps = None   # set when trials start
        self._skip = 1
        self._window = []
        self._trials = []          # [(name, plan)] still to try, each candidate twice
        self._samples = {}         # candidate name -> its trial steps' figures
        self._plans = {}           # candidate name -> plan
        self.plan = None           # the plan running now (None: the default)
        self.candidate = None      # its name: planned, fused or buckets
        self._baseline = None      # the running plan's figure (its trial's until steady)
        self._steady = False       # whether _baseline is the running plan's own window
        self._drifted = 0          # consecutive windows off the baseline
        self.step = 0

    def _candidates(self, ready):
        return candidates(self.sizes, ready, self._cost, self._algorithms, self.bucket_bytes)

    def _event(self, phase, name, plan, measured=None, **extra):
        record = {"event": "plan", "phase": phase, "step": self.step, "candidate": name,
                  "buckets": len(plan.buckets),
                  "algorithms": dict(collections.Counter(b.algorithm for b in plan.buckets)),
                  "bucket_mb": [round(float(self.sizes[b.first:b.stop].sum()) / 2 ** 20, 3)
                                for b in plan.buckets],
                  "predicted_sync_s": plan.predicted_finish_s,
                  "predicted_exposed_s": plan.predicted_exposed_s}
        if measured is not None:
            record["measured_sync_s"] = measured
        record.update(extra)
        self._on_event(record)

    def _start_trials(self, reason):
        if self._cost is None:
            self._cost, source = self._cost_model()
            self._algorithms = self._algorithms or self._cost.algorithms
            self._on_event({"event": "plan", "phase": "cost model", "step": self.step,
                            "source": source, "algorithms": list(self._algorithms)})
        # One collective for both: the layers' ready times and the sync figure, maxed.
        agreed = self._agree(np.append(np.median(np.array(self._ready), axis=0),
                                       np.median(self._recent)))
        ready, sync_s = agreed[:-1], float(agreed[-1])
        self._half_steps, self._check_steps = trial_half_steps(sync_s), check_steps(sync_s)
        found = self._candidates(ready)
        self._trials = found + found[::-1]
        self._samples = {name: [] for name, _ in found}
        self._plans = dict(found)
        self._reason = reason
        self.candidate = None
        return self._next_trial()

    def _next_trial(self):
        name, plan = self._trials.pop(0)
        self._window = []
        if name == self.candidate:    # the middle of A B C C B A: the buckets stay
            return None
        self.candidate, self.plan = name, plan
        self._skip = 1                # the first step on new buckets is not typical
        return plan.buckets

    def _choose(self):
        """After the last trial: every candidate's figure, agreed, then the fastest runs."""
        names = list(self._samples)
        figures = self._agree(np.array([np.median(self._samples[n]) for n in names]))
        results = [(n, self._plans[n], float(f)) for n, f in zip(names, figures)]
        for name, plan, measured in results:
            self._event("trial", name, plan, measured)
        name, plan, best = _fastest(results)
        self._window, self._skip = [], int(name != self.candidate)
        self.candidate, self.plan, self._baseline, self._steady = name, plan, best, False
        self._event("chosen", name, plan, best, reason=self._reason)
        return plan.buckets

    def observe(self, ready, sync_s):
        """One finished step: ready = each layer's ready time after the first layer's (or
        None if backward did not run every layer), sync_s = backward span + exposed
        communication. Returns new buckets (planner.Bucket tuple) to use from the next step
        on, or None to keep the current ones."""
        self.step += 1
        if self._skip:
            self._skip -= 1
            return None
        if ready is not None:
            self._ready.append(ready)
            self._recent.append(sync_s)
        if self.plan is None:                             # measuring on the default plan
            if len(self._ready) == self._ready.maxlen:
                return self._start_trials("initial")
            return None
        self._window.append(sync_s)
        if self._baseline is None:                        # trying candidates
            if len(self._window) < self._half_steps:
                return None
            self._samples[self.candidate] += self._window
            if self._trials:
                return self._next_trial()
            return self._choose()
        if len(self._window) < self._check_steps:
            return None
        measured = float(self._agree(np.array([np.median(self._window)]))[0])
        self._window = []
        if not self._steady:
            self._baseline, self._steady = measured, True
            self._event("steady", self.candidate, self.plan, measured)
            return None
        # Two drifted windows in a row: one slow window is noise (another job, a page-cache
        # flush), not a change in the model's timings.
        self._drifted = self._drifted + 1 if planner.should_replan(self._baseline, measured,
                                                                    DRIFT) else 0
        if self._drifted >= 2:
            reason = f"drift: {1e3 * measured:.2f} ms against {1e3 * self._baseline:.2f} ms"
            self._baseline, self._drifted = None, 0
            return self._start_trials(reason)
        return None
