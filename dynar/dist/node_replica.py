"""One replica per node: the ranks of a node keep a single copy of the model's parameters and
the optimizer's velocity in memory they share (an MPI-3 shared window), and each rank
averages and updates its own slice of them.

Replicating the model in every rank of a node makes averaging the gradient a copy-heavy
allreduce between processes that could read each other's memory, and makes every rank run
the whole optimizer over the whole model. Here each rank's gradient buffer lives in the
window too, so for a bucket [start, stop) rank r of L:

    1. waits until every rank of the node has finished the bucket (a node barrier);
    2. sums its slice of the bucket over the L gradient buffers into its own (one pass);
    3. on several nodes, allreduces that slice with the ranks holding the same slice on
       the other nodes (ranks with the same node index form a communicator: `cross`);
then after backward each rank's optimizer updates its slice of the shared parameters and
velocity, and a node barrier ends the step before anyone reads a parameter again.

Per rank and step that is about 3/L of the gradient's bytes for averaging and 1/L of the
optimizer's work, against copying the whole gradient in and out of shared memory and
updating the whole model (docs/PERFORMANCE.md has the measurements). Replicas stay
identical for free inside a node (there is one), and across nodes because each slice's
inputs and summation order are the same on every node.

Used when every node runs the same number of ranks (more than one) and the wire is not
compressed; otherwise, or with DYNAR_NODE_REPLICA=off (for comparisons), each rank keeps its
own replica and the allreduce does everything.
"""
import os

import numpy as np

from . import nodes, runtime


def wanted(comm, model, compress):
    """Whether the job should share one replica per node. Collective over `comm`, and safe
    to call before the ranks have checked that they agree on the model: ranks that differ in
    anything this depends on all get False and the start-up agreement names the difference."""
    node = nodes.split_by_node(comm, nodes.env_node_key())
    local = node.Get_size()
    node.Free()
    enabled = os.environ.get("DYNAR_NODE_REPLICA", "on") != "off"
    mine = np.array([local, model.flat_params.size, compress is None, enabled], np.int64)
    low = np.empty_like(mine)
    high = np.empty_like(mine)
    MPI = runtime.mpi()
    comm.Allreduce(mine, low, op=MPI.MIN)
    comm.Allreduce(mine, high, op=MPI.MAX)
    return bool((low == high).all() and local > 1 and compress is None and enabled)


class NodeReplica:
    """Moves `model`'s flat buffers into node-shared memory (collective over `comm`).

    Then: `owned` is this rank's (lo, hi) slice of the flat buffers; `momentum` the shared
    velocity to hand the optimizer; `cross` the communicator of the ranks that own the same
    slice on every node. close() (collective) moves the model back to private memory."""

    def __init__(self, model, comm):
        MPI = runtime.mpi()
        self._ar = runtime.allreduce()
        self._model = model
        self.node = nodes.split_by_node(comm, nodes.env_node_key())
        self.size, self.rank = self.node.Get_size(), self.node.Get_rank()
        self.cross = comm.Split(color=self.rank, key=comm.Get_rank())
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
        if self.rank == 0:
            self.params[:] = model.flat_params
            self.momentum.fill(0)
        self.grads[self.rank].fill(0)
        self.barrier()
        model.place_flat_buffers(self.params, self.grads[self.rank])
        self.owned = (n * self.rank // self.size, n * (self.rank + 1) // self.size)

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

    def average(self, start, stop, threads=1):
        """Once every rank of the node has finished gradients [start, stop): this rank's part
        of it, the mean over the node, in this rank's gradient buffer. Returns that part's
        (lo, hi), possibly empty; the caller averages it over `cross` next."""
        lo, hi = max(start, self.owned[0]), min(stop, self.owned[1])
        self.barrier()
        if hi > lo:
            others = [g[lo:hi] for r, g in enumerate(self.grads) if r != self.rank]
            self._ar.mean_into(self.grads[self.rank][lo:hi], others, 1.0 / self.size, threads)
        return lo, hi

    def describe(self):
        """What every rank of the job must agree on."""
        return {"ranks per node": self.size, "nodes": self.cross.Get_size()}

    def close(self):
        """Collective: give the model private copies of its buffers and free the window."""
        self.barrier()
        self._model.place_flat_buffers(self.params.copy(), self.grads[self.rank].copy())
        self.barrier()
        self._window.Unlock_all()
        self._window.Free()
        self.cross.Free()
        self.node.Free()
