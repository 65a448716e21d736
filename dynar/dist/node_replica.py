"""One replica per node: the ranks of a node keep a single copy of the model's parameters and
the optimizer's velocity in memory they share (an MPI-3 shared window), and each rank
averages and updates its own part of every gradient bucket.

Replicating the model in every rank of a node makes averaging the gradient a copy-heavy
allreduce between processes that could read each other's memory, and makes every rank run
the whole optimizer over the whole model. Here each rank's gradient buffer lives in the
window too, so for a bucket [start, stop) rank r of L:

    1. waits until every rank of the node has finished the bucket (a node barrier);
    2. sums its 1/L part of the bucket over the L gradient buffers into its own (one pass);
    3. on several nodes, allreduces that part with the ranks holding the same part on
       the other nodes (ranks with the same node index form a communicator: `cross`);
then after backward each rank's optimizer updates its parts of the shared parameters and
velocity, and a node barrier ends the step before anyone reads a parameter again.

Per rank and step, averaging reads every rank's part and writes one, (L+1)/L of the
gradient's bytes, and the optimizer does 1/L of the work, against copying the whole gradient
in and out of shared memory and updating the whole model (measured:
docs/notes/2026-12-01-node-replica.md). Replicas stay identical for free inside a node (there
is one), and across nodes because each part's inputs and summation order are the same on
every node.

Used when every node runs the same number of ranks (more than one) and the wire is not
compressed; otherwise, or with DYNAR_NODE_REPLICA=off (for comparisons), each rank keeps its
own replica and the allreduce does everything.
"""
import os
import sys

import numpy as np

from . import nodes, runtime


def wanted(comm, parameters=0, compress=None):
    """Whether a job training `parameters` floats with `compress` should share one replica
    per node. Collective over `comm`, and safe to call before the ranks have checked that
    they agree on the model: ranks that differ in anything this depends on all get False,
    and the start-up agreement names the difference."""
    MPI = runtime.mpi()
    node = nodes.split_by_node(comm, nodes.env_node_key())
    local = node.Get_size()
    # A DYNAR_NODE_KEY "node" must still share memory: all its ranks on one host.
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    host_id = host.bcast(comm.Get_rank(), root=0)
    host.Free()
    one_host = node.allreduce(host_id, op=MPI.MIN) == node.allreduce(host_id, op=MPI.MAX)
    node.Free()
    enabled = os.environ.get("DYNAR_NODE_REPLICA", "on") != "off"
    # MPI libraries back shared windows with files in /dev/shm; containers often mount a
    # small one (Docker: 64 MB), where the window would fail to allocate or fault.
    room = _shared_memory_room(4 * parameters * (local + 2))
    mine = np.array([local, parameters, compress is None, enabled, one_host, room is None],
                    np.int64)
    low = np.empty_like(mine)
    high = np.empty_like(mine)
    comm.Allreduce(mine, low, op=MPI.MIN)
    comm.Allreduce(mine, high, op=MPI.MAX)
    alike = (low[:4] == high[:4]).all() and local > 1 and compress is None and enabled
    if alike and low[4] and not low[5] and comm.Get_rank() == 0:
        why = room or "/dev/shm is too small on another node"
        print(f"dynar: one replica per rank, not per node: {why}", file=sys.stderr, flush=True)
    return bool(alike and low[4] and low[5])


def _shared_memory_room(needed):
    """None if /dev/shm can hold `needed` more bytes (or does not exist), else why not."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    if free >= needed:
        return None
    return (f"/dev/shm has {free / 2**20:,.0f} MB free, the shared replica needs "
            f"{needed / 2**20:,.0f} MB (enlarge it, e.g. docker run --shm-size)")


def split(comm):
    """(node, cross): the ranks of this rank's node, and the ranks with this rank's index on
    every node (each node's part of a bucket travels among them). Collective over `comm`."""
    node = nodes.split_by_node(comm, nodes.env_node_key())
    return node, comm.Split(color=node.Get_rank(), key=comm.Get_rank())


class NodeReplica:
    """Moves `model`'s flat buffers and `optimizer`'s velocity (an SGD over all of the
    model's parameters, or None) into node-shared memory, keeping local rank 0's values
    (collective over `comm`).

    Then `cross` is the communicator of the ranks with this rank's node index on every node,
    which average the same parts. Each step: average() every bucket, then update the ranges
    take_averaged() returns, then barrier(). close() (collective) moves model and optimizer
    back to private memory, holding the values they had."""

    def __init__(self, model, optimizer, comm):
        MPI = runtime.mpi()
        self._ar = runtime.allreduce()
        self._model, self._optimizer = model, optimizer
        self.node, self.cross = split(comm)
        self.size, self.rank = self.node.Get_size(), self.node.Get_rank()
        n = model.flat_params.size
        # Local rank 0 holds the node's parameters and velocity; every rank its gradient.
        # Non-contiguous allocation gives each rank its own pages, placed by its first touch.
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        own = (3 if self.rank == 0 else 1) * n * 4
        self._window = MPI.Win.Allocate_shared(own, 4, info, self.node)
        info.Free()
        self._window.Lock_all(MPI.MODE_NOCHECK)
        segments = [self._segment(r) for r in range(self.size)]
        self.params, self.momentum = segments[0][n:2 * n], segments[0][2 * n:3 * n]
        self.grads = [segment[:n] for segment in segments]
        velocity = None if optimizer is None else optimizer.momentum_buffer
        if self.rank == 0:
            self.params[:] = model.flat_params
            self.momentum[:] = 0 if velocity is None else velocity
        self.grads[self.rank].fill(0)
        self.barrier()
        model.place_flat_buffers(self.params, self.grads[self.rank])
        if optimizer is not None:
            optimizer.relocate(None if velocity is None else self.momentum)
        self._averaged = []

    def _segment(self, rank):
        memory, _ = self._window.Shared_query(rank)
        return np.frombuffer(memory, np.float32)

    def barrier(self):
        """Every rank of the node has reached this point, and sees the others' writes."""
        self._ar.window_barrier(self.node, self._window)

    def broadcast_parameters(self):
        """Rank 0's parameters on every node (collective over the job)."""
        self.barrier()
        if self.rank == 0:
            self.cross.Bcast(self.params, root=0)
        self.barrier()

    def part(self, start, stop):
        """This rank's (lo, hi) of the flat range [start, stop): the node's ranks split every
        bucket evenly, so all of them work on each bucket as soon as it is final."""
        n = stop - start
        return start + n * self.rank // self.size, start + n * (self.rank + 1) // self.size

    def average(self, start, stop, threads=1):
        """Once every rank of the node has finished gradients [start, stop): this rank's part
        of it, the mean over the node, in this rank's gradient buffer. Returns that part's
        (lo, hi), possibly empty; the caller averages it over `cross` next."""
        lo, hi = self.part(start, stop)
        self.barrier()
        if hi > lo:
            others = [g[lo:hi] for r, g in enumerate(self.grads) if r != self.rank]
            self._ar.mean_into(self.grads[self.rank][lo:hi], others, 1.0 / self.size, threads)
        self._averaged.append((lo, hi))
        return lo, hi

    def averaged(self):
        """The (lo, hi) ranges this rank has averaged since take_averaged() last ran: its
        parts of this step's averaged gradient (the node's other ranks hold the rest)."""
        return list(self._averaged)

    def take_averaged(self):
        """The (lo, hi) ranges this rank has averaged since the last call: the slices of the
        shared parameters its optimizer step updates (the node's other ranks update the rest)."""
        ranges, self._averaged = self._averaged, []
        return ranges

    def leave(self):
        """Give model and optimizer private copies of the shared buffers (not collective:
        also the way out after an error, when the other ranks may be anywhere)."""
        self._model.place_flat_buffers(self.params.copy(), self.grads[self.rank].copy())
        if self._optimizer is not None:
            velocity = self._optimizer.momentum_buffer
            self._optimizer.relocate(None if velocity is None else velocity.copy())

    def describe(self):
        """What every rank of the job must agree on."""
        return {"ranks per node": self.size, "nodes": self.cross.Get_size()}

    def close(self):
        """Collective: give model and optimizer private copies of their buffers and free the
        window."""
        self.barrier()
        self.leave()
        self.barrier()
        self._window.Unlock_all()
        self._window.Free()
        self.cross.Free()
        self.node.Free()
