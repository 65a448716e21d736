"""Data-parallel training: one object that makes a model and its optimizer train together
on every rank of a job.

    job = Job.start()                      # MPI_COMM_WORLD under mpiexec, else a job of one
    with DataParallel(model, opt, job) as dp:
        for x, y in batches:               # each rank its own share of the global batch
            model.zero_grad(lazy=True)
            loss = crit.forward(model.forward(x), y)
            model.backward(crit.backward())   # gradients are averaged while this runs
            dp.step(loss)                  # the rest of the averaging, then the update

Micro-batches of a larger batch run backward inside `with dp.no_sync():` but the last (as
DDP's); `dp.clip_grad_norm_(max_norm)` between backward and step() clips by the averaged
gradient's norm. BatchNorm layers take their training statistics over every rank's batch
(SyncConfig.batchnorm "global", as SyncBatchNorm; batch_stats.py) or each over its own
("local", DDP's default).

What it sets up, in this order (docs/DESIGN.md, "A step across ranks"):
1. placement: where the ranks of a node can share one replica (node_replica.py), the
   model's flat buffers and the optimizer's velocity move into node-shared memory;
2. the gradient synchronizer (sync.py), listening to backward's grad-ready reports;
3. the start-up agreement: ranks that build another model or sync stop with an error
   naming the difference (with the caller's own fields, `agree=`);
4. with global BatchNorm, the group every BatchNorm layer of the model sums over;
5. rank 0's parameters and buffers on every rank;
6. the watchdog (watchdog.py): a lost rank, or one that does not arrive within
   `stall_timeout` seconds where others wait for it, ends the job naming it.
close() undoes 1, 2, 4 and 6, collectively; leaving the `with` block by an exception undoes them
on this rank alone, without waiting for ranks that may never arrive. In a job of one,
step() is the optimizer's step and nothing else is set up.

Each step ends with one decision every rank takes alike, from a few counts allreduced after
the gradients (or alone, in a job of one): whether a loss or the averaged gradient is
non-finite (then the update is skipped or NonFiniteError raised, before any parameter
changes), and whether some rank was asked to stop (step(stop=...), e.g. by a signal), which
every rank then learns at the same step. The allreduce is dynar's own, which waits for
slower ranks without spinning: an MPI library's blocking collective here, spinning while
its peers still compute, made a LeNet step 40% slower on a loaded machine
(docs/notes/2026-12-02-faults-and-preemption.md).
"""
import contextlib
import dataclasses
import math
import time
from typing import NamedTuple, Optional

import numpy as np

from .. import kernels
from ..kernels.sgd import all_finite
from ..optim import clip
from . import planner
from .job import CollectiveError, Job
from .watchdog import collectives

NONFINITE_POLICIES = ("raise", "skip", "off")
# The decision's counts: one per stop code (a signal number, 1..MAX_STOP), then the ranks
# whose loss is non-finite, the sum of their ranks (which names the rank when it is one),
# and the ranks whose share of the gradient is.
MAX_STOP = 64
_BAD_LOSS, _BAD_LOSS_RANKS, _BAD_GRADIENT = MAX_STOP, MAX_STOP + 1, MAX_STOP + 2

BATCHNORM_MODES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How gradients are averaged: `mode` (sync.MODES: dynamic, buckets, fused, per-layer),
    the bucket size of the buckets mode and of dynamic's measuring steps, an optional 16-bit
    wire format (dist/wire.py), where tuning files live (None: tuning.tuning_dir()), and
    what BatchNorm layers normalize over when training: the global batch ("global") or each
    rank's share of it ("local")."""
    mode: str = "dynamic"
    bucket_mb: float = planner.DEFAULT_BUCKET_MB
    compress: Optional[str] = None
    tune_dir: Optional[str] = None
    batchnorm: str = "global"


class StepReport(NamedTuple):
    comm_exposed: float   # seconds waiting for communication that backward did not hide
    update: float         # seconds of the optimizer's update (and the node's barrier)
    stop: int = 0         # the stop request some rank made this step (its signal number), or 0
    skipped: bool = False  # non-finite loss or gradient: no update (on_nonfinite="skip")
    batch_stats: float = 0.0   # seconds in BatchNorm's sums over the ranks (forward, backward)


class NonFiniteError(CollectiveError):
    """A step's loss (on some rank) or averaged gradient holds inf or NaN; raised on every
    rank alike, before the update."""


class DataParallel:
    """Trains `model` with `optimizer` (a dynar.optim.SGD over the model's parameters) on
    every rank of `job` (default Job.start()). config: a SyncConfig; threads: threads that
    sum large buffers (default: the kernels' thread count); on_event(dict) receives Dynamic
    Allreduce's plan records; tracer: a dist.trace.Tracer; agree: {name: JSON value} the
    ranks must also share (checked with the model and the sync settings). on_nonfinite:
    what a non-finite loss or averaged gradient does, "raise" (NonFiniteError), "skip" (no
    update this step, on every rank) or "off" (no check); first_step: the number of steps
    done before this one (a resumed run's), for the step numbers in errors; stall_timeout:
    the watchdog's limit in seconds (0: no watchdog)."""

    def __init__(self, model, optimizer, job=None, config=None, *, threads=None,
                 on_event=None, tracer=None, agree=None, on_nonfinite="raise", first_step=0,
                 stall_timeout=0):
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite: {on_nonfinite!r}, expected one of "
                             f"{', '.join(NONFINITE_POLICIES)}")
        self.model, self.optimizer = model, optimizer
        self.job = job or Job.start()
        self.config = config or SyncConfig()
        self.on_nonfinite, self.steps = on_nonfinite, first_step
        if self.config.batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm: unknown {self.config.batchnorm!r}; choose global or "
                             f"local")
        self.node = self.sync = self.watchdog = self._decision = self.batch_stats = None
        self._exposed = None        # this step's exposed communication, once synchronized
        if not self.job.distributed:
            return
        from . import node_replica, runtime
        from .batch_stats import BatchStatsGroup
        from .sync import GradientSynchronizer
        comm = self.job.comm
        try:
            covers_model = getattr(optimizer, "size", None) == model.flat_params.size
            if covers_model and node_replica.wanted(comm, model.flat_params.size,
                                                    self.config.compress):
                self.node = node_replica.NodeReplica(model, optimizer, comm)
            self.sync = GradientSynchronizer(
                model, comm, self.config.mode, self.config.bucket_mb, self.config.compress,
                threads or kernels.threads.get_num_threads(), on_event, tracer,
                self.config.tune_dir, node=self.node)
            self.job.agree({**(agree or {}),
                            "parameters": [[name, list(p.shape)]
                                           for name, p in model.named_parameters()],
                            "sync": self.sync.describe(), "batchnorm": self.config.batchnorm,
                            "step decision": [on_nonfinite, first_step],
                            "stall timeout": stall_timeout})
            norms = model.batch_norm_layers()
            if norms and self.config.batchnorm == "global":
                # One thread at a time in MPI: a sum waits for the buckets handed off before it.
                wait = None if runtime.threads_concurrent() else self.sync.quiesce
                self.batch_stats = BatchStatsGroup(comm if self.node is None else None,
                                                   self.node, wait)
                for layer in norms:
                    layer.batch_stats_group = self.batch_stats
            # Replicas start identical: rank 0's parameters and buffers everywhere.
            if self.node is not None:
                self.node.broadcast_parameters()
            else:
                self.job.broadcast(model.flat_params)
            self.broadcast_buffers()
            from .collective import Collective
            self._decision = Collective(comm)
            if stall_timeout > 0:
                from .watchdog import Watchdog
                self.watchdog = Watchdog(self.job.comm, stall_timeout)
        except BaseException:
            self._abandon()
            raise

    @contextlib.contextmanager
    def no_sync(self):
        """Within: backward accumulates this rank's gradients and nothing is averaged (the
        micro-batches of a step but its last, as DDP's no_sync); the first backward after it
        averages everything accumulated. BatchNorm still sums its statistics over the ranks:
        that is the forward's math, not gradient sync."""
        if self.sync is None:
            yield
            return
        if self.sync.accumulating:
            raise RuntimeError("DataParallel.no_sync: already inside no_sync()")
        self.sync.accumulating = True
        try:
            yield
        finally:
            self.sync.accumulating = False

    def synchronize(self):
        """After backward: finish averaging this step's gradients (step() does it if this was
        not called); returns the seconds of communication backward did not hide."""
        if self.sync is not None and self.sync.accumulating:
            raise RuntimeError("DataParallel: the gradients cannot be averaged inside "
                               "no_sync(); leave it for the step's last backward")
        if self._exposed is None:
            self._exposed = self.sync.finish() if self.sync is not None else 0.0
        return self._exposed

    def clip_grad_norm_(self, max_norm):
        """Scale the averaged gradient to a 2-norm of at most max_norm (as
        torch.nn.utils.clip_grad_norm_ after DDP's backward); returns the norm before
        clipping, the same figure on every rank. Between backward and step()."""
        self.synchronize()
        if self.node is None:
            norm2 = clip.squared_norm(self.model.flat_grads)
            ranges = None
        else:
            # Each rank of a node holds its own parts of the averaged gradient.
            ranges = self.node.averaged()
            norm2 = sum(self.node.node.allgather(clip.squared_norm(self.model.flat_grads,
                                                                   ranges)))
        if self.job.distributed:
            # Rank 0's figure everywhere: the same coefficient on every replica whatever
            # the cores summing the squares.
            norm2 = (self.job.comm if self.node is None else self.node.cross).bcast(norm2)
        norm = norm2 ** 0.5
        clip.scale_gradients(self.model.flat_grads, clip.clip_coefficient(norm, max_norm),
                             ranges)
        return norm

    def step(self, loss=None, stop=0):
        """After backward: finish averaging the gradients, decide with the other ranks (this
        rank's `loss`, if given, and its `stop` request: a positive int, e.g. a signal
        number), then update the parameters (with a node replica, this rank's parts of them,
        then wait for the node's other ranks before anyone reads a parameter again).
        Returns a StepReport; raises NonFiniteError (on every rank) under on_nonfinite
        "raise"."""
        if not 0 <= stop <= MAX_STOP:
            raise ValueError(f"stop: a signal number from 1 to {MAX_STOP}, or 0; got {stop!r}")
        exposed = self.synchronize()
        self._exposed = None
        ranges = self.node.take_averaged() if self.node is not None else None
        stop, bad_loss_rank, bad_gradient = self._decide(loss, stop, ranges)
        self.steps += 1
        nonfinite = bad_loss_rank is not None or bad_gradient
        if nonfinite and self.on_nonfinite == "raise":
            raise NonFiniteError(f"non-finite {_what(bad_loss_rank, bad_gradient, self.job)} "
                                 f"at step {self.steps}")
        t0 = time.perf_counter()
        if not nonfinite:
            self.optimizer.step(ranges)
        if self.node is not None:
            with collectives.inside("the node's barrier after the update"):
                self.node.barrier()
        batch_stats = self.batch_stats.take_seconds() if self.batch_stats is not None else 0.0
        return StepReport(exposed, time.perf_counter() - t0, stop, nonfinite, batch_stats)

    def _decide(self, loss, stop, ranges):
        """(the largest stop request, the rank whose loss is non-finite (-1: several; None:
        none), whether the averaged gradient is): every rank checks its own share of the
        gradient, the one it updates with a node replica, else 1/world of it (the averaged
        gradient is bitwise the same on every rank), and one allreduce tells everyone."""
        check = self.on_nonfinite != "off"
        counts = np.zeros(MAX_STOP + 3)
        if stop:
            counts[stop - 1] = 1
        if check and loss is not None and not math.isfinite(loss):
            counts[_BAD_LOSS], counts[_BAD_LOSS_RANKS] = 1, self.job.rank
        if check:
            grads = self.model.flat_grads
            if ranges is None:
                n, rank, world = grads.size, self.job.rank, self.job.world
                ranges = [(n * rank // world, n * (rank + 1) // world)]
            counts[_BAD_GRADIENT] = not all(all_finite(grads[lo:hi]) for lo, hi in ranges
                                            if hi > lo)
        if self._decision is not None:
            with collectives.inside("the end-of-step decision"):
                self._decision.allreduce_mean(counts, "recursive_doubling", threads=1)
            counts = np.rint(counts * self.job.world)     # means of counts: exact integers
        stops = np.flatnonzero(counts[:MAX_STOP])
        bad_loss = counts[_BAD_LOSS]
        return (int(stops[-1]) + 1 if stops.size else 0,
                None if not bad_loss else int(counts[_BAD_LOSS_RANKS]) if bad_loss == 1 else -1,
                bool(counts[_BAD_GRADIENT]))

    def broadcast_buffers(self):
        """Every rank's buffers (BatchNorm running statistics) become rank 0's, as DDP's
        broadcast_buffers: before evaluating or saving, so that all ranks hold one model."""
        if self.job.distributed:
            for _, buf in self.model.named_buffers():
                self.job.broadcast(buf)

    def describe(self):
        """What this job runs: {"sync", "node replica", "compress", "batchnorm"} (None in a
        job of one; batchnorm None for a model without BatchNorm)."""
        norms = bool(self.model.batch_norm_layers())
        return {"sync": None if self.sync is None else self.config.mode,
                "node replica": None if self.node is None else self.node.describe(),
                "compress": None if self.sync is None else self.config.compress,
                "batchnorm": self.config.batchnorm if norms and self.sync is not None
                else None}

    def close(self):
        """Collective: stop synchronizing, give model and optimizer private memory again."""
        self._leave_batch_stats()
        if self.batch_stats is not None:
            self.batch_stats.free()
        if self.sync is not None:
            self.sync.close()
        if self.node is not None:
            self.node.close()
        if self._decision is not None:
            self._decision.free()
        if self.watchdog is not None:
            self.watchdog.close()
        self.sync = self.node = self.watchdog = self._decision = self.batch_stats = None

    def _abandon(self):
        self._leave_batch_stats()
        if self.sync is not None:
            self.sync.abandon()
        if self.node is not None:
            self.node.leave()
        if self.watchdog is not None:
            self.watchdog.abandon()
        self.sync = self.node = self.watchdog = self._decision = self.batch_stats = None

    def _leave_batch_stats(self):
        # The model used alone again normalizes over its own batches.
        for layer in self.model.batch_norm_layers():
            layer.batch_stats_group = None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is None:
            self.close()
        else:
            self._abandon()
        return False


def _what(bad_loss_rank, bad_gradient, job):
    loss = None if bad_loss_rank is None else "loss" if job.world == 1 else (
        f"loss (rank {bad_loss_rank})" if bad_loss_rank >= 0 else "loss (several ranks)")
    return " and ".join(x for x in (loss, "gradient" if bad_gradient else None) if x)
