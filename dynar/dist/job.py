"""This process's place in a data-parallel job: rank, world, node layout, and the few
collective steps besides gradient sync (start-up agreement, broadcasts, small sums).

A process not started by mpiexec is a job of one and never loads MPI."""
import hashlib
import json
import os
import sys
import time

from . import runtime
from .watchdog import collectives


# Where a launcher or the user says how many threads a rank gets, in order of precedence.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")


class CollectiveError(RuntimeError):
    """An error every rank raises alike, at the same point of the job: no rank is left in a
    collective, so the job can end without MPI_Abort (one rank reports it)."""


class ConfigMismatch(CollectiveError):
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
        comm = runtime.mpi().COMM_WORLD
        runtime.check_world_size(comm.Get_size())
        return cls(comm)

    @property
    def distributed(self):
        return self.comm is not None and self.world > 1

    def default_threads(self):
        """(threads, source): OMP_NUM_THREADS when set, else SLURM_CPUS_PER_TASK when set,
        else the node's cores shared out among the ranks on it; never more than the CPUs
        this process may run on (a launcher that binds a rank to one core gets one
        thread). `source` says which, in words for the start line."""
        allowed = _allowed_cpus()
        for name in THREAD_VARIABLES:
            requested = _thread_count_from(name)
            if requested is not None:
                if requested > allowed:
                    return allowed, (f"{name}={requested}, capped to the {allowed} CPU(s) "
                                     f"this rank may run on")
                return requested, f"{name}={requested}"
        cores, share = os.cpu_count() or 1, self.node_share()
        if share < cores // self.local_size:
            return share, f"the {share} CPU(s) this rank is bound to"
        return share, f"{cores} cores / {self.local_size} rank(s) on this node"

    def node_share(self):
        """The cores this rank has to itself: the node's cores divided among the ranks on
        it, never more than the CPUs this process may run on."""
        return max(1, min(_allowed_cpus(), (os.cpu_count() or 1) // self.local_size))

    def agree(self, fields):
        """Check that every rank has the same `fields` (name -> JSON-able value). On any
        difference every rank raises the same ConfigMismatch naming the first field that
        differs, so no rank is left waiting in a collective the others never reach."""
        if not self.distributed:
            return
        digest = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()
                  for k, v in fields.items()}
        with collectives.inside("the start-up agreement"):
            everyone = self.comm.allgather((digest, {k: _short(v) for k, v in fields.items()}))
        for name in fields:
            values = [d[0].get(name) for d in everyone]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {d[1].get(name)}" for r, d in enumerate(everyone))
                raise ConfigMismatch(f"ranks disagree on {name} ({shown})")
        names = [sorted(d[0]) for d in everyone]
        if any(n != names[0] for n in names):
            raise ConfigMismatch("ranks disagree on the set of start-up fields (dynar versions differ?)")

    def from_rank0(self, make):
        """make() called on rank 0 only, its result (pickled) returned on every rank; an
        exception on rank 0 is raised on every rank. For work every rank would repeat
        against a shared file system (listing an image folder of a million files)."""
        if not self.distributed:
            return make()
        # One collective for the watchdog, rank 0's work included: it has arrived.
        with collectives.inside("work rank 0 does for every rank"):
            result = error = None
            if self.rank == 0:
                try:
                    result = make()
                except Exception as exc:  # noqa: BLE001 - handed to every rank, raised there
                    error = exc
            # The others sleep meanwhile: rank 0 may be timing kernels on the cores they share.
            wait_politely(self.comm)
            error = self.comm.bcast(error, root=0)
            if error is not None:
                raise error
            return self.comm.bcast(result, root=0)

    def broadcast(self, array):
        """Overwrite `array` in place with rank 0's."""
        if self.distributed:
            with collectives.inside("a broadcast from rank 0"):
                self.comm.Bcast(array, root=0)

    def sum(self, values):
        """Element-wise sum over ranks of a float64 numpy array (small: metrics)."""
        if not self.distributed:
            return values
        out = values.copy()
        with collectives.inside("a sum over ranks"):
            self.comm.Allreduce(values, out, op=runtime.mpi().SUM)
        return out

    def abort(self, message, code=1):
        """Print `message` (one line) and end the whole job: MPI_Abort on a distributed job,
        so ranks blocked in a collective do not hang."""
        prefix = f"[rank {self.rank}] " if self.world > 1 else ""
        if self.distributed:
            runtime.end_job(f"{prefix}{message}", code)
        print(f"{prefix}{message}", file=sys.stderr, flush=True)
        raise SystemExit(code)


def wait_politely(comm):
    """A barrier over `comm` that sleeps while it waits: MPI's own spins, taking the cores
    of the ranks still working. It polls every 5 ms (a wait meant for seconds, not the
    allreduce's microseconds)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def _allowed_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _thread_count_from(name):
    """The thread count in environment variable `name` (OpenMP's nested form "8,2" gives
    8), None when unset or empty; anything but a whole number >= 1 is a ValueError."""
    text = os.environ.get(name, "").split(",")[0].strip()
    if not text:
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a whole number of threads >= 1")
    return count


def _short(value, limit=120):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."
