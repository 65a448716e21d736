"""Dynamic Allreduce's online part: measure, plan, try, keep, and re-plan on drift.

The planner's model prices messages and knows when backward finalizes each layer, but not
what communicating *during* backward costs backward itself: the communication thread's
copies and sums take cycles from the compute threads. So the plan it prefers is not trusted
blindly: it is tried against the baselines it must beat, and the fastest *measured* wins.

The phases, each decided from figures gathered from every rank, so every rank switches
plans at the same step (collective sequences can never differ):

1. measure: MEASURE_STEPS steps on the default plan, recording each layer's ready time;
2. trial:   each candidate (candidates()) runs in two blocks, every candidate once and then
            again in reverse order (A B C C B A), so a trend in step times adds about as
            much to every candidate's figure; a block first runs warmup_steps() unmeasured
            steps. A candidate's figure is the median over its measured steps of the step's
            backward span + exposed communication (what sync can change), averaged over
            ranks;
3. run:     the fastest candidate (one with more buckets only if it wins by more than TIE).
            Its first check_steps() steps give its steady figure (event phase "steady");
            two check windows in a row beyond DRIFT of that start a new trial from fresh
            timings.
Trials and checks last at least TRIAL_STEPS and CHECK_STEPS steps, and on fast steps as many
as fill TRIAL_SECONDS and CHECK_SECONDS.

Every decision is logged as a JSON event "plan" (phase "cost model": where the prices came
from; then trial, chosen and steady, with the predicted and the measured figure). The
measurements behind each rule: docs/notes/2026-12-01-dynamic-allreduce.md and
docs/notes/2026-12-02-online-rules.md.
"""
import collections

import numpy as np

from . import planner

MEASURE_STEPS = 6      # the first is dropped: it pays for buffer allocation
TRIAL_STEPS = 4
TRIAL_SECONDS = 0.1
MAX_TRIAL_STEPS = 40
WARMUP_SECONDS = 0.15
MAX_WARMUP_STEPS = 60
CHECK_STEPS = 20
CHECK_SECONDS = 0.1
DRIFT = 0.2
# A plan with more buckets must beat one with fewer by this fraction of the figure to be
# chosen: within it the trials cannot tell them apart, and each extra bucket costs a
# hand-off the figure sees only as noise (docs/notes/2026-12-02-online-rules.md).
TIE = 0.05
# At most this many plans are tried: the planner's, and the two baselines with each of the
# three algorithm choices (candidates()).
MAX_CANDIDATES = 1 + 2 * 3


def _steps_filling(seconds, sync_s, least, most):
    return int(min(most, max(least, np.ceil(seconds / max(sync_s, 1e-9)))))


def trial_steps(sync_s):
    """Steps each candidate is measured in a trial when a step's sync figure is sync_s
    seconds."""
    return _steps_filling(TRIAL_SECONDS, sync_s, TRIAL_STEPS, MAX_TRIAL_STEPS)


def warmup_steps(sync_s):
    """Unmeasured steps at the start of a trial block, when a step's sync figure is sync_s
    seconds."""
    return _steps_filling(WARMUP_SECONDS, sync_s, 1, MAX_WARMUP_STEPS)


def trial_schedule(names, steps, warmup):
    """[(name, measured)] for the steps of a trial, in order: a block of `steps`/2 measured
    steps per candidate, then again in reverse order; a block starts with `warmup`
    unmeasured steps unless it continues the candidate before it."""
    schedule = []
    for name in names + names[::-1]:
        if not schedule or schedule[-1][0] != name:
            schedule += [(name, False)] * warmup
        schedule += [(name, True)] * -(-steps // 2)
    return schedule


def exploration_steps(sync_s, candidates=MAX_CANDIDATES):
    """At most how many steps go by before the first plan is chosen, when a step's sync
    figure is sync_s seconds: the measuring steps, then the trial's."""
    block = warmup_steps(sync_s) + -(-trial_steps(sync_s) // 2)
    return MEASURE_STEPS + 2 * candidates * block


def candidate_figures(per_rank, names):
    """{name: figure} from a trial's per-step figures of every rank (ranks x steps, identical
    on every rank) and the candidate each step ran: the median over the candidate's steps of
    the step's mean over ranks."""
    per_step = np.asarray(per_rank, np.float64).mean(axis=0)
    names = np.asarray(names)
    return {name: float(np.median(per_step[names == name])) for name in dict.fromkeys(names)}


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
            found[mode + suffix] = planner.evaluate(buckets, sizes, ready_s, cost)
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
    (None: all the cost model has); gather(array) -> every rank's array, one row per rank,
    identical on every rank (collective); on_event(dict) records decisions; bucket_bytes:
    the bucket size of the "buckets" baseline."""

    def __init__(self, sizes_bytes, cost_model, algorithms, gather, on_event, bucket_bytes):
        self.sizes = np.asarray(sizes_bytes, np.int64)
        self._cost_model, self._cost = cost_model, None
        self._algorithms = algorithms
        self._gather = gather
        self._on_event = on_event
        self.bucket_bytes = bucket_bytes
        self._ready = collections.deque(maxlen=MEASURE_STEPS - 1)
        self._recent = collections.deque(maxlen=MEASURE_STEPS - 1)   # sync figures
        self._check_steps = None   # set when trials start
        self._skip = 1
        self._window = []
        self._schedule = []        # [(name, measured)] trial steps still to run, this first
        self._trial = []           # [(name, figure)] of the trial's measured steps
        self._plans = {}           # candidate name -> plan
        self.plan = None           # the plan running now (None: the default)
        self.candidate = None      # its name: "planned" or a baseline's, e.g. "fused (mpi)"
        self._baseline = None      # the running plan's steady figure (None: not yet)
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
        # One collective for both: the layers' ready times and the sync figure, the
        # slowest rank's.
        agreed = self._gather(np.append(np.median(np.array(self._ready), axis=0),
                                        np.median(self._recent))).max(axis=0)
        ready, sync_s = agreed[:-1], float(agreed[-1])
        self._check_steps = check_steps(sync_s)
        found = self._candidates(ready)
        self._plans = dict(found)
        self._schedule = trial_schedule(list(self._plans), trial_steps(sync_s),
                                        warmup_steps(sync_s))
        self._trial = []
        self._reason = reason
        # Fresh plans: the first block switches even to a name that runs now (after drift,
        # "planned" is usually a different plan under the same name).
        self.candidate = None
        return self._run(self._schedule[0][0])

    def _run(self, name):
        """Buckets to switch to for running candidate `name` next, or None if it runs now."""
        if name == self.candidate:
            return None
        self.candidate, self.plan = name, self._plans[name]
        return self.plan.buckets

    def _trial_step(self, sync_s):
        """One trial step has run (the schedule's first)."""
        name, measured = self._schedule.pop(0)
        if measured:
            self._trial.append((name, sync_s))
        if self._schedule:
            return self._run(self._schedule[0][0])
        return self._choose()

    def _choose(self):
        """After the last trial step: every candidate's figure, agreed, then the fastest runs."""
        names, figures = zip(*self._trial)
        measured = candidate_figures(self._gather(np.array(figures)), names)
        results = [(n, plan, measured[n]) for n, plan in self._plans.items()]
        for name, plan, figure in results:
            self._event("trial", name, plan, figure, steps=names.count(name))
        name, plan, best = _fastest(results)
        self._window, self._skip = [], int(name != self.candidate)
        self.candidate, self.plan, self._baseline = name, plan, None
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
        if self._schedule:                                # trying candidates
            return self._trial_step(sync_s)
        if self.plan is None:                             # measuring on the default plan
            if len(self._ready) == self._ready.maxlen:
                return self._start_trials("initial")
            return None
        self._window.append(sync_s)
        if len(self._window) < self._check_steps:
            return None
        measured = candidate_figures(self._gather(np.array(self._window)),
                                     [self.candidate] * len(self._window))[self.candidate]
        self._window = []
        if self._baseline is None:
            self._baseline = measured
            self._event("steady", self.candidate, self.plan, measured)
            return None
        # Two drifted windows in a row: one slow window is noise (another job, a page-cache
        # flush), not a change in the model's timings.
        self._drifted = self._drifted + 1 if planner.should_replan(self._baseline, measured,
                                                                    DRIFT) else 0
        if self._drifted >= 2:
            reason = f"drift: {1e3 * measured:.2f} ms against {1e3 * self._baseline:.2f} ms"
            self._drifted = 0
            return self._start_trials(reason)
        return None
