"""Gradient synchronization: the model's flat gradient buffer, cut into buckets, each
averaged over ranks by dynar's allreduce as soon as backward has finalized it.

Backward finalizes layers front to back through flat_grads (the model lays its buffers out
that way), so every bucket is a run of whole layers, one contiguous slice, and "bucket b is
ready" is just "the finalized prefix reaches b's end" (the grad-ready protocol,
docs/DESIGN.md). A mode is one plan of buckets, all modes equal up to float summation order:

- per-layer: a bucket per layer, each reduced right after its backward, blocking (no overlap);
- fused:     one bucket for the whole buffer, reduced after backward (one start-up);
- buckets:   buckets of `bucket_mb` (25 MB like PyTorch DDP), each handed off the moment it
             is complete while backward goes on with earlier layers;
- dynamic:   Dynamic Allreduce: bucket boundaries and one algorithm per bucket from the
             planner (planner.py), fed with this job's measured backward timings and the
             tuned cost of each algorithm, tried against the baselines and re-planned when
             the timings drift (online.py).

When a handed-off bucket's allreduce runs is the progress engine's business (progress.py).
With a node replica (node_replica.py), reducing a bucket is averaging this rank's part of it
over the node's buffers in place, then allreducing that part among the nodes; the plans are
the same, priced for the part's size over the nodes.
"""
import os
import time

import numpy as np

from . import costmodel, planner, progress, runtime, tuning, wire
from .collective import Collective, compress_with_feedback
from .online import OnlinePlanner
from .trace import COMMUNICATION, TRAINING
from .watchdog import collectives

MODES = planner.MODES + ("dynamic",)
COMPRESSION = wire.FORMATS


_PROTOCOL = ("; every layer's backward must call self._grad_ready() once its parameter "
             "gradients are final, in the order the model's flat buffers hold the layers (the "
             "reverse of registration: docs/DESIGN.md, the grad-ready protocol)")


class GradReadyError(RuntimeError):
    """A layer broke the grad-ready protocol: it reported its gradients final out of order,
    twice, or never."""


class GradientSynchronizer:
    """Averages a model's gradients over `comm` during and after backward.

    Use: sync = GradientSynchronizer(model, comm, "dynamic"); each step call sync.finish()
    after backward (before the optimizer); close() when done. compress="fp16"/"bf16" puts
    16-bit values on the wire (ring allreduce, float32 sums, error feedback); on_event
    receives the planner's records (dicts with "event": "plan"); tracer (dist.trace.Tracer)
    records per-layer and per-bucket spans. node (a NodeReplica, built on the model first)
    makes the ranks of each node average their shared gradients in place, each its own part
    of every bucket, and allreduce only that part among nodes; the optimizer must then
    update only the parts node.take_averaged() returns. dist/data_parallel.py puts these
    together."""

    def __init__(self, model, comm, mode="dynamic", bucket_mb=planner.DEFAULT_BUCKET_MB,
                 compress=None, threads=1, on_event=None, tracer=None, tune_dir=None,
                 node=None):
        if mode not in MODES:
            raise ValueError(f"sync: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if compress not in (None,) + COMPRESSION:
            raise ValueError(f"compress: unknown {compress!r}; choose fp16, bf16 or None")
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_mb} MB")
        if node is not None and compress:
            raise ValueError("compress: a node-shared replica has no wire inside the node; "
                             "compress without it")
        self.mode, self.comm, self.compress, self.node = mode, comm, compress, node
        self.world = comm.Get_size()
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self._grads = model.flat_grads
        self._layers = [(name, start, stop) for name, _, start, stop in model.grad_ready_order()]
        self._layer_at = {start: name for name, start, _ in self._layers}
        self._layer_ending_at = {stop: name for name, _, stop in self._layers}   # for the trace
        self._sizes = np.array([4 * (stop - start) for _, start, stop in self._layers], np.int64)
        self._on_event = on_event or (lambda record: None)
        self.tracer = tracer
        self.progress = "thread" if runtime.threads_supported() else "calls"
        if os.environ.get("DYNAR_SYNC_PROGRESS") == "calls":
            self.progress = "calls"
        # With a node replica, MPI carries only each rank's parts among the nodes.
        self.collective = Collective(comm if node is None else node.cross,
                                     reduce_threads=threads)
        self._residual = np.zeros_like(self._grads) if compress else None
        self._tune_dir = tune_dir
        algorithm = "ring" if compress else "mpi"
        self.buckets = self._slices(planner.static_buckets(
            self._sizes, "buckets" if mode == "dynamic" else mode, self.bucket_bytes, algorithm))
        self.online, self._all_ranks = None, None
        if mode == "dynamic" and self.collective.size > 1:
            self._start_online_planner()
        self._engine = self._progress_engine()
        # While set, backward accumulates this rank's gradients and nothing is reduced (the
        # micro-batches before a step's last: DataParallel.no_sync).
        self.accumulating = False
        self._handle = model.register_grad_ready_hook(self._on_grad_ready)
        self._begin_step()

    def _progress_engine(self):
        if self.world == 1 or self.mode == "fused":
            return progress.AtFinish()
        if self.mode == "per-layer":
            return progress.Blocking(self._reduce)
        if self.progress == "thread":
            return progress.CommThread(self._reduce)
        if self.compress or self.node:
            # MPI_Iallreduce has no 16-bit wire and cannot average shared memory.
            return progress.AtFinish()
        return progress.NonblockingCalls(self._start_mean)

    # -- plans ------------------------------------------------------------------------------

    def _slices(self, buckets):
        """Layer-run buckets as (start, stop, algorithm) slices of the flat gradient."""
        return [(self._layers[b.first][1], self._layers[b.stop - 1][2], b.algorithm)
                for b in buckets]

    def _start_online_planner(self):
        # Every rank of the job agrees on plans; with a node replica the collective spans
        # only the ranks that hold this rank's parts.
        self._all_ranks = self.collective.comm_handle if self.node is None else self.comm.Dup()
        # The cost model is found (loaded, or briefly tuned) when it first plans: after the
        # start-up agreement, so ranks of a misconfigured job never reach the tuning
        # collectives with different message sizes. On the wire a compressed bucket is half
        # its float32 size; with a node replica a rank sends 1/L of each bucket, so the
        # 25 MB baseline is 25/L MB in those units.
        shrink = (2 if self.compress else 1) * (1 if self.node is None else self.node.size)
        if self.compress:
            allowed = ("ring",)       # the one algorithm with a 16-bit wire format
        elif self.progress == "calls":
            allowed = ("mpi",)        # only MPI_Iallreduce progresses without a thread
        else:
            allowed = None            # every algorithm the cost model prices
        self.online = OnlinePlanner(self._sizes // shrink, self._cost_model, allowed,
                                    self._gather_over_ranks, self._on_event,
                                    self.bucket_bytes // shrink)

    def _gather_over_ranks(self, values):
        values = np.ascontiguousarray(values, np.float64)
        out = np.empty((self._all_ranks.Get_size(), values.size), np.float64)
        with collectives.inside("Dynamic Allreduce's exchange of timings"):
            self._all_ranks.Allgather(values, out)
        return out

    def _cost_model(self):
        largest = int(self._sizes.sum())
        if self.node is None:
            return tuning.cost_model_for(self.collective, largest, self._tune_dir)
        # Only the node leaders' communicator measures; its model reaches the node's
        # other ranks, so that every rank plans the same buckets.
        found = None
        if self.node.rank == 0:
            model, source = tuning.cost_model_for(self.collective, largest // self.node.size,
                                                  self._tune_dir)
            found = (model.to_json(), source)
        self.node.barrier()     # waits without spinning on the cores the leaders measure on
        found = self.node.node.bcast(found, root=0)
        return costmodel.CostModel.from_json(found[0]), found[1]

    # -- one step ---------------------------------------------------------------------------

    def _begin_step(self):
        self._next = 0          # first bucket not yet handed off
        self._finalized = 0     # end of the flat prefix whose gradients are final
        self._ready = []        # perf_counter() as backward finalizes each layer

    def _reduce(self, index, threads=None):
        """Allreduce bucket `index` (on whichever thread calls this; `threads` sums)."""
        start, stop, algorithm = self.buckets[index]
        t0 = time.perf_counter()
        with collectives.inside(f"the gradient allreduce (bucket {index})"):
            if self.node is not None:
                start, stop = self.node.average(start, stop,
                                                threads or self.collective.reduce_threads)
            buf = self._grads[start:stop]
            if self.compress:
                compress_with_feedback(buf, self._residual[start:stop], self.compress)
            self.collective.allreduce_mean(buf, algorithm, self.compress, threads)
        if self.tracer is not None:
            self.tracer.span(f"allreduce {index}", t0, time.perf_counter(), COMMUNICATION,
                             algorithm=algorithm, bytes=4 * (stop - start),
                             wire=self.compress or "float32")

    def _start_mean(self, index):
        start, stop, _ = self.buckets[index]
        collectives.posted()
        return runtime.allreduce().start_mean(self._grads[start:stop],
                                              self.collective.comm_handle)

    def _on_grad_ready(self, start, stop):
        if self.accumulating:
            return
        now = time.perf_counter()
        if start != self._finalized:
            self._engine.complete()   # leave no reduction half done behind the error
            reporting = self._layer_at[start]
            raise GradReadyError(
                (f"layer {reporting!r} reported its gradients final twice in one backward"
                 if start < self._finalized else
                 f"layer {self._layer_at[self._finalized]!r} had not reported its gradients "
                 f"final when layer {reporting!r} did") + _PROTOCOL)
        self._finalized = stop
        if self.tracer is not None:
            previous = self._ready[-1] if self._ready else now
            self.tracer.span(f"backward {self._layer_ending_at.get(stop, 'layer')}", previous,
                             now, TRAINING)
        self._ready.append(now)
        while self._next < len(self.buckets) and self.buckets[self._next][1] <= stop:
            if not self._engine.hand_off(self._next, self._next == len(self.buckets) - 1):
                break
            self._next += 1
        self._engine.poll()

    def finish(self):
        """Complete every bucket (reducing those the engine did not take); returns the
        seconds spent waiting for communication that backward did not hide: here, plus
        per-layer mode's blocking waits inside backward."""
        t0 = time.perf_counter()
        blocked = self._engine.complete()
        if self._finalized != int(self._grads.size):
            layer = self._layer_at.get(self._finalized)
            self._begin_step()
            raise GradReadyError(f"layer {layer!r} never reported its gradients final during "
                                 f"backward" + _PROTOCOL)
        if self.world > 1:
            while self._next < len(self.buckets):
                self._reduce(self._next)
                self._next += 1
        t1 = time.perf_counter()
        exposed = t1 - t0 + blocked
        if self.tracer is not None:
            self.tracer.span("wait for allreduce", t0, t1, TRAINING)
        if self.online is not None and self._layers:
            ready = np.array(self._ready) - self._ready[0]
            buckets = self.online.observe(ready, float(ready[-1]) + exposed)
            if buckets is not None:
                self.buckets = self._slices(buckets)
        self._begin_step()
        return exposed

    def quiesce(self):
        """Wait until no bucket handed off so far is being reduced (the progress engine's
        quiesce): then the training thread may call MPI where MPI serializes threads."""
        self._engine.quiesce()

    def close(self):
        """Collective: stop the progress engine and free the communicators."""
        self._handle.remove()
        self._engine.close()
        if self.node is not None and self._all_ranks is not None:
            self._all_ranks.Free()
        self.collective.free()

    def abandon(self):
        """Local teardown after an error (the other ranks may be anywhere): stop listening to
        backward and stop the progress engine without waiting for MPI."""
        self._handle.remove()
        self._engine.abandon()

    def describe(self):
        """What every rank must agree on (part of the start-up fingerprint)."""
        return {"sync": self.mode, "buckets": [list(b) for b in self.buckets],
                "progress": self.progress, "compress": self.compress,
                "node replica": None if self.node is None else self.node.describe()}
