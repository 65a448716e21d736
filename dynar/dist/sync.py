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
             cost of each algorithm, re-planned when the measured timings drift.

How buckets progress while backward computes (measured, docs/PERFORMANCE.md): a
communication thread runs the blocking allreduce of one bucket after another (GIL
released), which needs MPI_THREAD_SERIALIZED: only that thread calls MPI while backward runs,
and finish() waits for it before anything else does. Open MPI's blocking allreduce of
AlexNet's 93 MB gradient costs 7-8 ms in 4-25 MB pieces against 25-65 ms for its nonblocking
MPI_Iallreduce, whose progress also has to be driven by hand. Where the MPI library offers
no SERIALIZED support, buckets fall back to MPI_Iallreduce driven by test() calls between
layers on the training thread (DYNAR_SYNC_PROGRESS=calls forces it, for comparison and
tests); dynamic mode then plans with the MPI library's algorithm only.
"""
import collections
import os
import queue
import threading
import time

import numpy as np

from . import planner, runtime, tuning
from .trace import COMMUNICATION, TRAINING

MODES = planner.MODES + ("dynamic",)
COMPRESSION = ("fp16", "bf16")

# Dynamic mode: steps run on the safe default plan (25 MB buckets, the MPI library's
# allreduce) while backward timings are measured; the first of them is not used (it pays for
# buffer allocation and warm caches).
MEASURE_STEPS = 6
# After each plan: steps whose median is taken as the plan's measured figure, and the
# relative drift of later windows from it that triggers a re-plan.
CHECK_STEPS = 20
DRIFT = 0.2


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
    records per-layer and per-bucket spans."""

    def __init__(self, model, comm, mode="dynamic", bucket_mb=25.0, compress=None,
                 threads=1, on_event=None, tracer=None, tune_dir=None):
        if mode not in MODES:
            raise ValueError(f"sync: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if compress not in (None,) + COMPRESSION:
            raise ValueError(f"compress: unknown {compress!r}; choose fp16, bf16 or None")
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_mb} MB")
        self.mode, self.comm, self.compress = mode, comm, compress
        self.world = comm.Get_size()
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self._grads = model.flat_grads
        self._layers = [(name, start, stop) for name, _, start, stop in model.grad_ready_order()]
        self._sizes = np.array([4 * (stop - start) for _, start, stop in self._layers], np.int64)
        self._on_event = on_event or (lambda record: None)
        self.tracer = tracer
        self.progress = "thread" if runtime.threads_supported() else "calls"
        if os.environ.get("DYNAR_SYNC_PROGRESS") == "calls":
            self.progress = "calls"
        self._ar = runtime.allreduce()
        self.collective = runtime.collective(comm, reduce_threads=threads)
        self._residual = np.zeros_like(self._grads) if compress else None
        # Dynamic mode's cost model is found (loaded, or briefly tuned) when it first plans:
        # after the start-up agreement, so ranks of a misconfigured job never reach the
        # tuning collectives with different message sizes.
        self.cost, self.cost_source, self._tune_dir = None, None, tune_dir
        self._default_algorithm = "ring" if compress else "mpi"
        static = "buckets" if mode == "dynamic" else mode
        self.buckets = self._slices(planner.static_buckets(self._sizes, static, self.bucket_bytes,
                                                           self._default_algorithm))
        self.plan = None
        self._thread = None
        if self.world > 1 and self.progress == "thread" and mode in ("buckets", "dynamic"):
            self._thread = _CommThread()
        self._handle = model.register_grad_ready_hook(self._on_grad_ready)
        # Dynamic mode's measurements: per step, each layer's ready time (seconds after the
        # first layer's) and the synchronization figure backward span + exposed.
        self._ready_history = collections.deque(maxlen=MEASURE_STEPS - 1)
        self._window = []
        self._baseline = None
        self.steps = 0
        self._begin_step()

    # -- plans ------------------------------------------------------------------------------

    def _slices(self, buckets):
        """Layer-run buckets as (start, stop, algorithm) slices of the flat gradient."""
        return [(self._layers[b.first][1], self._layers[b.stop - 1][2], b.algorithm)
                for b in buckets]

    def _candidates(self):
        if self.compress:
            return ("ring",)          # the one algorithm with a 16-bit wire format
        if self.progress == "calls":
            return ("mpi",)           # only MPI_Iallreduce progresses without a thread
        return self.cost.algorithms

    def _replan(self, reason):
        """Plan from the slowest rank's median ready times: every rank gets the same input,
        so the same plan. Collective; called between steps (communication idle)."""
        if self.cost is None:
            self.cost, self.cost_source = tuning.cost_model_for(
                self.collective, int(self._sizes.sum()), self._tune_dir)
        local = np.median(np.array(self._ready_history), axis=0)
        ready = np.empty_like(local)
        self.collective.comm_handle.Allreduce(local, ready, op=runtime.mpi().MAX)
        # On the wire a compressed bucket is half its float32 size.
        sizes = self._sizes // 2 if self.compress else self._sizes
        new = planner.plan(sizes, ready, self.cost, self._candidates())
        self.plan = new
        self.buckets = self._slices(new.buckets)
        self._baseline, self._window = None, []
        self._on_event({"event": "plan", "phase": "planned", "step": self.steps,
                        "reason": reason, "cost_model": self.cost_source,
                        "buckets": len(new.buckets),
                        "algorithms": collections.Counter(b.algorithm for b in new.buckets),
                        "bucket_mb": [round(float(sizes[b.first:b.stop].sum()) / 2 ** 20, 3)
                                      for b in new.buckets],
                        "predicted_sync_s": new.predicted_finish_s,
                        "predicted_exposed_s": new.predicted_exposed_s,
                        "backward_s": float(ready[-1])})

    def _observe(self, ready, exposed):
        """Dynamic mode, after each step: plan once timings are measured, then compare each
        window of CHECK_STEPS steps with the first one after the plan and re-plan on drift."""
        if ready is not None:
            self._ready_history.append(ready)
        if self.plan is None:
            if self.steps >= MEASURE_STEPS and len(self._ready_history) == MEASURE_STEPS - 1:
                self._replan("initial")
            return
        self._window.append((0.0 if ready is None else ready[-1]) + exposed)
        if len(self._window) < CHECK_STEPS:
            return
        local = np.array([np.median(self._window)])
        measured = np.empty_like(local)
        self.collective.comm_handle.Allreduce(local, measured, op=runtime.mpi().MAX)
        measured = float(measured[0])
        self._window = []
        if self._baseline is None:
            self._baseline = measured
            self._on_event({"event": "plan", "phase": "measured", "step": self.steps,
                            "predicted_sync_s": self.plan.predicted_finish_s,
                            "measured_sync_s": measured})
        elif planner.should_replan(self._baseline, measured, DRIFT):
            self._replan(f"drift: {measured * 1e3:.2f} ms against {self._baseline * 1e3:.2f} ms")

    # -- one step ---------------------------------------------------------------------------

    def _begin_step(self):
        self._next = 0          # first bucket not yet handed to MPI
        self._in_flight = []    # Pending reductions (progress by test() calls)
        self._blocked = 0.0     # seconds per-layer mode spent blocked inside backward
        self._ready = []        # perf_counter() as backward finalizes each layer

    def _reduce(self, index):
        """Allreduce bucket `index` (on whichever thread calls this)."""
        start, stop, algorithm = self.buckets[index]
        buf = self._grads[start:stop]
        t0 = time.perf_counter()
        if self.compress:
            self._ar.compress_with_feedback(buf, self._residual[start:stop], self.compress)
        self.collective.allreduce_mean(buf, algorithm, self.compress)
        if self.tracer is not None:
            self.tracer.span(f"allreduce {index}", t0, time.perf_counter(), COMMUNICATION,
                              algorithm=algorithm, bytes=4 * (stop - start),
                              wire=self.compress or "float32")

    def _on_grad_ready(self, start, stop):
        now = time.perf_counter()
        if self.tracer is not None:
            previous = self._ready[-1] if self._ready else now
            name = next((n for n, s, e in self._layers if e == stop), "layer")
            self.tracer.span(f"backward {name}", previous, now, TRAINING)
        self._ready.append(now)
        if self.world == 1 or self.mode == "fused":
            return
        while self._next < len(self.buckets) and self.buckets[self._next][1] <= stop:
            index = self._next
            self._next += 1
            if self.mode == "per-layer":
                t0 = time.perf_counter()
                self._reduce(index)
                self._blocked += time.perf_counter() - t0
            elif self._thread is not None:
                self._thread.submit(lambda index=index: self._reduce(index))
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
        self.steps += 1
        if self.mode == "dynamic" and self.world > 1:
            self._observe(ready, exposed)
        self._begin_step()
        return exposed

    def close(self):
        """Collective: stop the communication thread and free the communicators."""
        self._handle.remove()
        if self._thread is not None:
            self._thread.close()
        self.collective.free()

    def describe(self):
        """What every rank must agree on (part of the start-up fingerprint)."""
        return {"sync": self.mode, "buckets": [list(b) for b in self.buckets],
                "progress": self.progress, "compress": self.compress}
