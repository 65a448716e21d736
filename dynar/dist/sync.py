"""Gradient synchronization: the model's flat gradient buffer, cut into buckets, each
averaged over ranks by dynar's allreduce as soon as backward has finalized it.

Backward finalizes layers front to back through flat_grads (the model lays its buffers out
that way), so every bucket is one contiguous slice and "bucket b is ready" is just "the
finalized prefix reaches b's end". Modes (`--sync`), all equal up to float summation order:

- per-layer: a blocking allreduce of each layer right after its backward (no overlap);
- fused:     one allreduce of the whole buffer after backward (no overlap, one start-up);
- buckets:   fixed-size buckets (`bucket_mb`, 25 MB like PyTorch DDP), each handed off the
             moment it is complete while backward goes on with earlier layers.

How buckets progress while backward computes (measured, docs/PERFORMANCE.md): by default a
communication thread runs the MPI library's blocking MPI_Allreduce on one bucket after
another (GIL released), which needs MPI_THREAD_SERIALIZED: only that thread calls MPI while
backward runs, and finish() waits for it before anything else does. Open MPI's blocking
allreduce of AlexNet's 93 MB gradient costs 7-8 ms in 4-25 MB pieces against 25-65 ms for
its nonblocking MPI_Iallreduce, whose progress also has to be driven by hand. Where the MPI
library offers no SERIALIZED support, buckets fall back to MPI_Iallreduce driven by test()
calls between layers on the training thread (DYNAR_SYNC_PROGRESS=calls forces it, for
comparison and tests).
"""
import os
import queue
import threading
import time

from . import runtime

MODES = ("per-layer", "fused", "buckets")


def plan_buckets(order, mode, bucket_bytes):
    """[(start, stop)] slices of the flat gradient buffer, in the order they complete.

    order: the model's grad_ready_order(): [(layer, names, start, stop)] tiling the buffer."""
    if mode not in MODES:
        raise ValueError(f"sync: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if not order:
        return []
    if mode == "per-layer":
        return [(start, stop) for _, _, start, stop in order]
    if mode == "fused":
        return [(order[0][2], order[-1][3])]
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets, begin = [], order[0][2]
    for _, _, _, stop in order:
        # A layer is never split: its gradient becomes final all at once.
        if (stop - begin) * 4 >= bucket_bytes:
            buckets.append((begin, stop))
            begin = stop
    if begin < order[-1][3]:
        buckets.append((begin, order[-1][3]))
    return buckets


class _CommThread:
    """Runs blocking allreduces of submitted buffers, in order, on a thread of its own."""

    def __init__(self, reduce):
        self._reduce = reduce
        self._queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._loop, name="dynar-allreduce", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            buf = self._queue.get()
            try:
                if buf is None:
                    return
                if self._error is None:
                    self._reduce(buf)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    def submit(self, buf):
        self._queue.put(buf)

    def drain(self):
        """Wait until every submitted buffer is reduced; re-raise a failure."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"gradient allreduce failed: {self._error}") from self._error

    def close(self):
        self._queue.put(None)
        self._thread.join()


class GradientSynchronizer:
    """Averages a model's gradients over `comm` during and after backward.

    Use: sync = GradientSynchronizer(model, comm, "buckets"); each step call sync.finish()
    after backward (before the optimizer); close() when done."""

    def __init__(self, model, comm, mode="buckets", bucket_mb=25.0):
        self.mode = mode
        self.comm = comm
        self.world = comm.Get_size()
        self._allreduce = runtime.allreduce()
        self._grads = model.flat_grads
        self.buckets = plan_buckets(model.grad_ready_order(), mode, int(bucket_mb * 2 ** 20))
        self.progress = "thread" if runtime.threads_supported() else "calls"
        if os.environ.get("DYNAR_SYNC_PROGRESS") == "calls":
            self.progress = "calls"
        self._thread = None
        if mode == "buckets" and self.world > 1 and self.progress == "thread":
            self._thread = _CommThread(lambda buf: self._allreduce.allreduce_mean(buf, comm))
        self._handle = model.register_grad_ready_hook(self._on_grad_ready)
        self._begin_step()

    def _begin_step(self):
        self._next = 0          # first bucket not yet handed to MPI
        self._in_flight = []    # Pending reductions (progress by test() calls)
        self._blocked = 0.0     # seconds per-layer mode spent blocked inside backward

    def _slice(self, index):
        start, stop = self.buckets[index]
        return self._grads[start:stop]

    def _on_grad_ready(self, start, stop):
        if self.world == 1 or self.mode == "fused":
            return
        while self._next < len(self.buckets) and self.buckets[self._next][1] <= stop:
            buf = self._slice(self._next)
            self._next += 1
            if self.mode == "per-layer":
                t0 = time.perf_counter()
                self._allreduce.allreduce_mean(buf, self.comm)
                self._blocked += time.perf_counter() - t0
            elif self._thread is not None:
                self._thread.submit(buf)
            else:
                self._in_flight.append(self._allreduce.start_mean(buf, self.comm))
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
                self._allreduce.allreduce_mean(self._slice(self._next), self.comm)
                self._next += 1
        exposed = time.perf_counter() - t0 + self._blocked
        self._begin_step()
        return exposed

    def close(self):
        self._handle.remove()
        if self._thread is not None:
            self._thread.close()

    def describe(self):
        """What every rank must agree on (part of the start-up fingerprint)."""
        return {"sync": self.mode, "buckets": [list(b) for b in self.buckets],
                "progress": self.progress}
