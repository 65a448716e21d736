"""Gradient synchronization: the model's flat gradient buffer, cut into buckets, each
averaged over ranks by dynar's allreduce as soon as backward has finalized it.

Backward finalizes layers front to back through flat_grads (the model lays its buffers out
that way), so every bucket is one contiguous slice and "bucket b is ready" is just "the
finalized prefix reaches b's end". Modes (`--sync`), all equal up to float summation order:

- per-layer: a blocking allreduce of each layer right after its backward (no overlap);
- fused:     one allreduce of the whole buffer after backward (no overlap, one start-up);
- buckets:   fixed-size buckets (`bucket_mb`, 25 MB like PyTorch DDP), each posted the
             moment it is complete while backward goes on with earlier layers.

Progress: Open MPI and MPICH advance a nonblocking collective only inside MPI calls, so the
synchronizer calls test() on the buckets in flight each time a layer finishes (between
layers, on the training thread; no communication thread competing for the cores).
"""
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


class GradientSynchronizer:
    """Averages a model's gradients over `comm` during and after backward.

    Use: sync = GradientSynchronizer(model, comm, "buckets"); each step call
    sync.begin_step() before backward and sync.finish() after it (before the optimizer)."""

    def __init__(self, model, comm, mode="buckets", bucket_mb=25.0):
        self.mode = mode
        self.comm = comm
        self.world = comm.Get_size()
        self._allreduce = runtime.allreduce()
        self._grads = model.flat_grads
        self.buckets = plan_buckets(model.grad_ready_order(), mode, int(bucket_mb * 2 ** 20))
        self._overlap = mode != "fused" and self.world > 1
        self._handle = model.register_grad_ready_hook(self._on_grad_ready)
        self.begin_step()

    def begin_step(self):
        self._next = 0          # first bucket not yet posted
        self._in_flight = []
        self._blocked = 0.0     # seconds per-layer mode spent blocked inside backward

    def _post(self, index):
        start, stop = self.buckets[index]
        return self._allreduce.start_mean(self._grads[start:stop], self.comm)

    def _on_grad_ready(self, start, stop):
        if not self._overlap:
            return
        while self._next < len(self.buckets) and self.buckets[self._next][1] <= stop:
            pending = self._post(self._next)
            self._next += 1
            if self.mode == "per-layer":
                t0 = time.perf_counter()
                pending.wait()
                self._blocked += time.perf_counter() - t0
            else:
                self._in_flight.append(pending)
        # Drive the reductions already posted while backward still has layers to run.
        for pending in self._in_flight:
            pending.test()

    def finish(self):
        """Complete every bucket (posting those backward did not); returns the seconds spent
        waiting for communication that backward did not hide: here, plus per-layer mode's
        blocking waits inside backward."""
        t0 = time.perf_counter()
        if self.world > 1:
            while self._next < len(self.buckets):
                self._in_flight.append(self._post(self._next))
                self._next += 1
            for pending in self._in_flight:
                pending.wait()
        exposed = time.perf_counter() - t0 + self._blocked
        self.begin_step()
        return exposed

    def close(self):
        self._handle.remove()

    def describe(self):
        """What every rank must agree on (part of the start-up fingerprint)."""
        return {"sync": self.mode, "buckets": [list(b) for b in self.buckets]}
