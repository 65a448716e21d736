"""When a bucket's allreduce runs: the progress engines of the gradient synchronizer.

The synchronizer offers each bucket to its engine the moment backward has finalized it
(hand_off), lets the engine drive its work between layers (poll), and at the step's end
waits for what the engine took (complete) before reducing the buckets it declined itself.
Which engine a job gets is sync.py's choice: per-layer mode blocks, fused mode waits for the
end, overlapped modes use the communication thread where the MPI library allows one
(MPI_THREAD_SERIALIZED), else nonblocking calls. Why a thread and not MPI_Iallreduce, in
numbers: docs/notes/2026-11-30-communication-progress.md.
"""
import queue
import threading
import time

from .watchdog import collectives


class AtFinish:
    """Nothing moves during backward: the synchronizer reduces every bucket after it. The
    base of the other engines, which override what they do differently."""

    def hand_off(self, index, last):
        """Bucket `index` (the step's last if `last`) is final; True if the engine takes it."""
        return False

    def poll(self):
        """Drive the buckets taken so far (called after every layer's backward)."""

    def complete(self):
        """Wait until every bucket taken this step is reduced; returns the seconds the
        hand-offs blocked the training thread inside backward."""
        return 0.0

    def quiesce(self):
        """Return once no other thread of this process is inside MPI, so that the training
        thread may run a collective of its own where MPI lets one thread at a time call it
        (the buckets taken so far keep their place before it in every rank's order)."""

    def close(self):
        """Stop for good (after complete())."""

    def abandon(self):
        """Stop without waiting for MPI (after an error: the other ranks may be anywhere)."""


class Blocking(AtFinish):
    """Each bucket's allreduce runs on the training thread the moment it is final (per-layer
    mode: no overlap, the baseline that shows what overlap buys)."""

    def __init__(self, reduce):
        self._reduce = reduce
        self._blocked = 0.0

    def hand_off(self, index, last):
        t0 = time.perf_counter()
        self._reduce(index)
        self._blocked += time.perf_counter() - t0
        return True

    def complete(self):
        blocked, self._blocked = self._blocked, 0.0
        return blocked


class CommThread(AtFinish):
    """Blocking allreduces, in order, on a thread of their own (the GIL released while MPI
    runs): backward goes on with earlier layers meanwhile. Only this thread calls MPI while
    backward runs, and complete() waits for it before anything else does."""

    def __init__(self, reduce):
        self._reduce = reduce
        self._queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._loop, name="dynar-allreduce", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            index = self._queue.get()
            try:
                if index is None:
                    return
                if self._error is None:
                    # One summing thread beside backward: the compute threads own the cores.
                    self._reduce(index, threads=1)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = index, exc
            finally:
                self._queue.task_done()

    def hand_off(self, index, last):
        if last:
            # The last bucket is final when backward is: nothing is left to hide it behind,
            # and with more ranks than cores waking this thread waits for a time slice. The
            # synchronizer reduces it at once, with every core
            # (docs/notes/2026-12-02-online-rules.md).
            return False
        self._queue.put(index)
        return True

    def complete(self):
        self.quiesce()
        return 0.0

    def quiesce(self):
        self._queue.join()
        if self._error is not None:
            index, exc = self._error
            raise RuntimeError(f"the gradient allreduce of bucket {index} failed on the "
                               f"communication thread: {type(exc).__name__}: {exc}") from exc

    def close(self):
        self._queue.put(None)
        self._thread.join()

    def abandon(self):
        # The thread may be blocked in an MPI call that will never complete: it is a daemon
        # and dies with the process.
        self._queue.put(None)


class NonblockingCalls(AtFinish):
    """MPI_Iallreduce posted at hand-off, driven by test() calls between layers, for MPI
    libraries that grant no MPI_THREAD_SERIALIZED (DYNAR_SYNC_PROGRESS=calls forces it)."""

    def __init__(self, start):
        self._start = start
        self._in_flight = []

    def hand_off(self, index, last):
        self._in_flight.append(self._start(index))
        return True

    def poll(self):
        for pending in self._in_flight:
            pending.test()

    def complete(self):
        with collectives.waiting("the gradient allreduce (MPI_Iallreduce)"):
            for pending in self._in_flight:
                pending.wait()
        self._in_flight = []
        return 0.0
