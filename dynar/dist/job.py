"""This process's place in a data-parallel job: rank, world, node layout, and the few
collective steps besides gradient sync (start-up agreement, broadcasts, small sums).

A process not started by mpiexec is a job of one and never loads MPI."""
import hashlib
import json
import os
import sys

from . import runtime


class ConfigMismatch(RuntimeError):
    """Ranks were started with settings that cannot train one model together."""


class Job:
    def __init__(self, comm=None):
        self.comm = comm
        if comm is None:
            self.rank, self.world = 0, 1
            self.local_size, self.local_rank, self.nodes = 1, 0, 1
        else:
            self.rank, self.world = comm.Get_rank(), comm.Get_size()
            self.local_size, self.local_rank, self.nodes = runtime.node_layout(comm)

    @classmethod
    def start(cls):
        """MPI_COMM_WORLD's job when launched by mpiexec, else a job of one."""
        if not runtime.launched_by_mpiexec():
            return cls()
        return cls(runtime.mpi().COMM_WORLD)

    @property
    def distributed(self):
        return self.comm is not None and self.world > 1

    def default_threads(self):
        """The node's cores shared out among the ranks on it, within this process's
        affinity mask (a launcher that binds a rank to one core gets one thread)."""
        cores = os.cpu_count() or 1
        try:
            allowed = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            allowed = cores
        return max(1, min(allowed, cores // self.local_size))

    def agree(self, fields):
        """Check that every rank has the same `fields` (name -> JSON-able value). On any
        difference every rank raises the same ConfigMismatch naming the first field that
        differs, so no rank is left waiting in a collective the others never reach."""
        if not self.distributed:
            return
        digest = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()
                  for k, v in fields.items()}
        everyone = self.comm.allgather((digest, {k: _short(v) for k, v in fields.items()}))
        for name in fields:
            values = [d[0].get(name) for d in everyone]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {d[1].get(name)}" for r, d in enumerate(everyone))
                raise ConfigMismatch(f"ranks disagree on {name} ({shown})")
        names = [sorted(d[0]) for d in everyone]
        if any(n != names[0] for n in names):
            raise ConfigMismatch("ranks disagree on the set of start-up fields (dynar versions differ?)")

    def broadcast(self, array):
        """Overwrite `array` in place with rank 0's."""
        if self.distributed:
            self.comm.Bcast(array, root=0)

    def sum(self, values):
        """Element-wise sum over ranks of a float64 numpy array (small: metrics)."""
        if not self.distributed:
            return values
        out = values.copy()
        self.comm.Allreduce(values, out, op=runtime.mpi().SUM)
        return out

    def abort(self, message, code=1):
        """Print `message` (one line) and end the whole job: MPI_Abort on a distributed job,
        so ranks blocked in a collective do not hang."""
        prefix = f"[rank {self.rank}] " if self.world > 1 else ""
        print(f"{prefix}{message}", file=sys.stderr, flush=True)
        if self.distributed:
            self.comm.Abort(code)
        raise SystemExit(code)


def _short(value, limit=120):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."
