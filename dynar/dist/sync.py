"""Gradient synchronization: the model's flat gradient buffer, cut into buckets, each
averaged over ranks by dynar's allreduce as soon as backward has finalized it.

Backward finalizes layers front to back through flat_grads (the model lays its buffers out
that way), so every bucket is a run of whole layers, one contiguous slice, and "bucket b is
ready" is just "the finalized prefix reaches b's end". Modes (`--sync`), all equal up to
float summation order:

- per-layer: a blocking allreduce of each layer right after its backward (no overlap);
- fused:     one allreduce of the whole buffer after backward (no overlap, one start-up);
- buckets:   fixed-size buckets (`bucket_mb`, 25 MB like PyTorch DDP), each handed off the
             moment it is complete while backward goes on with earlier layers;
- dynamic:   Dynamic Allreduce (DESIGN.md): bucket boundaries and one algorithm per bucket
             from the planner, fed with this job's measured backward timings and the tuned
             cost of each algorithm, tried against the baselines and re-planned when the
             measured timings drift (dist/online.py).

How buckets progress while backward computes (measured, docs/PERFORMANCE.md): a
communication thread runs the blocking allreduce of one bucket after another (GIL
released), which needs MPI_THREAD_SERIALIZED: only that thread calls MPI while backward runs,
and finish() waits for it before anything else does. Open MPI's blocking allreduce of
AlexNet's 93 MB gradient costs 7-8 ms in 4-25 MB pieces against 25-65 ms for its nonblocking
MPI_Iallreduce, whose progress also has to be driven by hand. Where the MPI library offers
no SERIALIZED support, buckets fall back to MPI_Iallreduce driven by test() calls between
layers on the training thread (DYNAR_SYNC_PROGRESS=calls forces it, for comparison and
tests); dynamic mode then plans with the MPI library's algorithm only. Compressed buckets
(16-bit wire, dynar's ring only) and a node replica's shared buffers have no
MPI_Iallreduce: without the thread they are all reduced in finish().

With a node replica (dist/node_replica.py: the ranks of a node share parameters and
gradient buffers), "reducing a bucket" is averaging this rank's part of it over the node's
buffers in place, then allreducing that part among the nodes; the modes, buckets and plans
are the same, planned for the part's size over the nodes.
"""
import os
import queue
import threading
import time

import numpy as np

from . import costmodel, planner, runtime, tuning, wire
from .online import OnlinePlanner
from .trace import COMMUNICATION, TRAINING

MODES = planner.MODES + ("dynamic",)
COMPRESSION = wire.FORMATS



class _CommThread:
    """Runs submitted allreduce jobs, in order, on a thread of its own."""

    def __init__(self):
        self._queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._loop, name="dynar-allreduce", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    def submit(self, job):
        self._queue.put(job)

    def drain(self):
        """Wait until every submitted job has run; re-raise a failure."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"gradient allreduce failed: {self._error}") from self._error

    def close(self):
        self._queue.put(None)
        self._thread.join()


class GradientSynchronizer:
    """Averages a model's gradients over `comm` during and after backward.

    Use: sync = GradientSynchronizer(model, comm, "dynamic"); each step call sync.finish()
    after backward (before the optimizer); close() when done. compress="fp16"/"bf16" puts
    16-bit values on the wire (ring allreduce, float32 sums, error feedback); on_event
    receives the planner's records (dicts with "event": "plan"); tracer (dist.trace.Tracer)
    records per-layer and per-bucket spans. node (a dist.NodeReplica, built on the model
    first) makes the ranks of each node average their shared gradients in place, each its
    own part of every bucket, and allreduce only that part among nodes; the optimizer must
    then update only the parts node.take_averaged() returns."""

    def __init__(self, model, comm, mode="dynamic",
                 bucket_mb=planner.DEFAULT_BUCKET_BYTES / 2 ** 20, compress=None,
                 threads=1, on_event=None, tracer=None, tune_dir=None, node=None):
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
        self._layer_at_stop = {stop: name for name, _, stop in self._layers}  # for the trace
        self._sizes = np.array([4 * (stop - start) for _, start, stop in self._layers], np.int64)
        self._on_event = on_event or (lambda record: None)
        self.tracer = tracer
        self.progress = "thread" if runtime.threads_supported() else "calls"
        if os.environ.get("DYNAR_SYNC_PROGRESS") == "calls":
            self.progress = "calls"
        self._ar = runtime.allreduce()
        # With a node replica, MPI carries only each rank's parts among the nodes.
        self.collective = runtime.collective(comm if node is None else node.cross,
                                             reduce_threads=threads)
        among = self.collective.size
        self._residual = np.zeros_like(self._grads) if compress else None
        self._tune_dir = tune_dir
        self._default_algorithm = "ring" if compress else "mpi"
        static = "buckets" if mode == "dynamic" else mode
        self.buckets = self._slices(planner.static_buckets(self._sizes, static, self.bucket_bytes,
                                                           self._default_algorithm))
        self.online = None
        self._all_ranks = None
        if mode == "dynamic" and among > 1:
            # Every rank of the job agrees on plans; with a node replica the collective spans
            # only the ranks that hold this rank's parts.
            self._all_ranks = self.collective.comm_handle if node is None else comm.Dup()
            # The cost model is found (loaded, or briefly tuned) when it first plans: after
            # the start-up agreement, so ranks of a misconfigured job never reach the tuning
            # collectives with different message sizes. On the wire a compressed bucket is
            # half its float32 size; with a node replica a rank sends 1/L of each bucket, so
            # the 25 MB baseline is 25/L MB in those units.
            wire = 2 if compress else 1
            share = 1 if node is None else node.size
            self.online = OnlinePlanner(self._sizes // (wire * share), self._cost_model,
                                        self._allowed_algorithms(), self._gather_over_ranks,
                                        self._on_event, self.bucket_bytes // (wire * share))
        self._thread = None
        if self.world > 1 and self.progress == "thread" and mode in ("buckets", "dynamic"):
            self._thread = _CommThread()
        self._handle = model.register_grad_ready_hook(self._on_grad_ready)
        self._begin_step()

    # -- plans ------------------------------------------------------------------------------

    def _slices(self, buckets):
        """Layer-run buckets as (start, stop, algorithm) slices of the flat gradient."""
        return [(self._layers[b.first][1], self._layers[b.stop - 1][2], b.algorithm)
                for b in buckets]

    def _allowed_algorithms(self):
        if self.compress:
            return ("ring",)          # the one algorithm with a 16-bit wire format
        if self.progress == "calls":
            return ("mpi",)           # only MPI_Iallreduce progresses without a thread
        return None                   # every algorithm the cost model prices

    def _gather_over_ranks(self, values):
        values = np.ascontiguousarray(values, np.float64)
        out = np.empty((self._all_ranks.Get_size(), values.size), np.float64)
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
        self._next = 0          # first bucket not yet handed to MPI
        self._in_flight = []    # Pending reductions (progress by test() calls)
        self._blocked = 0.0     # seconds per-layer mode spent blocked inside backward
        self._ready = []        # perf_counter() as backward finalizes each layer

    def _reduce(self, index, threads=None):
        """Allreduce bucket `index` (on whichever thread calls this; `threads` sums)."""
        start, stop, algorithm = self.buckets[index]
        t0 = time.perf_counter()
        if self.node is not None:
            start, stop = self.node.average(start, stop, threads or self.collective.reduce_threads)
        buf = self._grads[start:stop]
        if self.compress:
            self._ar.compress_with_feedback(buf, self._residual[start:stop], self.compress)
        self.collective.allreduce_mean(buf, algorithm, self.compress, threads)
        if self.tracer is not None:
            self.tracer.span(f"allreduce {index}", t0, time.perf_counter(), COMMUNICATION,
                              algorithm=algorithm, bytes=4 * (stop - start),
                              wire=self.compress or "float32")

    def _on_grad_ready(self, start, stop):
        now = time.perf_counter()
        if self.tracer is not None:
            previous = self._ready[-1] if self._ready else now
            name = self._layer_at_stop.get(stop, "layer")
            self.tracer.span(f"backward {name}", previous, now, TRAINING)
        self._ready.append(now)
        if self.world == 1 or self.mode == "fused":
            return
        if self._thread is None and (self.compress or self.node) and self.mode != "per-layer":
            # MPI_Iallreduce has no 16-bit wire, and cannot average shared memory: reduce in
            # finish() instead
            return
        while self._next < len(self.buckets) and self.buckets[self._next][1] <= stop:
            if self._thread is not None and self._next == len(self.buckets) - 1:
                # The last bucket is final when backward is: nothing is left to hide it
                # behind, so finish() reduces it right away on this thread, with every core,
                # instead of waking the communication thread (with more ranks than cores
                # that wake-up waited for a time slice: LeNet's 1-bucket plan took 5.1 ms a
                # step against fused mode's 2.7 ms on 4 emulated hosts).
                break
            index = self._next
            self._next += 1
            if self.mode == "per-layer":
                t0 = time.perf_counter()
                self._reduce(index)
                self._blocked += time.perf_counter() - t0
            elif self._thread is not None:
                # One summing thread beside backward: the compute threads own the cores.
                self._thread.submit(lambda index=index: self._reduce(index, threads=1))
            else:
                start_, stop_, _ = self.buckets[index]
                self._in_flight.append(self._ar.start_mean(self._grads[start_:stop_],
                                                           self.collective.comm_handle))
        for pending in self._in_flight:   # drive posted reductions while backward goes on
            pending.test()

    def finish(self):
        """Complete every bucket (reducing those backward did not hand off); returns the
        seconds spent waiting for communication that backward did not hide: here, plus
        per-layer mode's blocking waits inside backward."""
        t0 = time.perf_counter()
        if self.world > 1:
            if self._thread is not None:
                self._thread.drain()
            for pending in self._in_flight:
                pending.wait()
            while self._next < len(self.buckets):
                self._reduce(self._next)
                self._next += 1
        t1 = time.perf_counter()
        exposed = t1 - t0 + self._blocked
        if self.tracer is not None:
            self.tracer.span("wait for allreduce", t0, t1, TRAINING)
        ready = None
        if len(self._ready) == len(self._layers) and self._layers:
            ready = np.array(self._ready) - self._ready[0]
        if self.online is not None:
            sync_s = (0.0 if ready is None else float(ready[-1])) + exposed
            buckets = self.online.observe(ready, sync_s)
            if buckets is not None:
                self.buckets = self._slices(buckets)
        self._begin_step()
        return exposed

    def close(self):
        """Collective: stop the communication thread and free the communicators."""
        self._handle.remove()
        if self._thread is not None:
            self._thread.close()
        if self.node is not None and self._all_ranks is not None:
            self._all_ranks.Free()
        self.collective.free()

    def describe(self):
        """What every rank must agree on (part of the start-up fingerprint)."""
        return {"sync": self.mode, "buckets": [list(b) for b in self.buckets],
                "progress": self.progress, "compress": self.compress,
                "node replica": None if self.node is None else self.node.describe()}
