"""A timeline of training steps across ranks, as Chrome-trace JSON (open it in Perfetto or
chrome://tracing).

Each rank records spans on its own clock, started right after a barrier, so all ranks share
one time origin to within the barrier's skew. At the end rank 0 gathers every rank's spans
and writes one file: one process row per rank, thread 0 the training thread (forward, each
layer's backward, the wait for communication, the update), thread 1 the communication
thread (each bucket's allreduce with its algorithm and size).
"""
import json
import threading
import time

from ..atomic_write import write_text

TRAINING, COMMUNICATION = 0, 1
_THREAD_NAMES = {TRAINING: "training", COMMUNICATION: "communication"}


class Tracer:
    def __init__(self, comm=None):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        if comm is not None:
            comm.Barrier()
        self.origin = time.perf_counter()
        self._events = []
        self._lock = threading.Lock()    # the communication thread records too

    def span(self, name, start, stop, thread=TRAINING, **args):
        """Record [start, stop) (time.perf_counter() seconds) on `thread`."""
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": thread,
                 "ts": round((start - self.origin) * 1e6, 3),
                 "dur": round((stop - start) * 1e6, 3)}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def write(self, path):
        """Collective: gather every rank's spans; rank 0 writes `path` atomically."""
        with self._lock:
            events = list(self._events)
        everyone = self.comm.gather(events, root=0) if self.comm is not None else [events]
        if self.rank != 0:
            return
        merged = []
        for rank, spans in enumerate(everyone):
            merged.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank}"}})
            merged += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": name}} for tid, name in _THREAD_NAMES.items()]
            merged += spans
        write_text(path, json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
