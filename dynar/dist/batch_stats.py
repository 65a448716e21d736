"""The ranks BatchNorm layers take their training statistics over (`--batchnorm global`, as
PyTorch's SyncBatchNorm): the group DataParallel gives every BatchNorm of its model
(nn.BatchNorm2d.batch_stats_group).

Each training forward of a BatchNorm over C channels sums 3C + 1 float64 values over the
ranks, each backward 2C (nn.batchnorm.group_sum_sizes): small messages on the critical path (nothing after the layer can
run before its statistics are known), so the fewest message steps win:
- where the ranks of each node share one replica (node_replica.py), through the node's shared
  memory: the node's ranks add their values up in a shared window (the hierarchical algorithm
  over the node alone), then the ranks with the same index on every node combine the node
  sums by recursive doubling, log2(nodes) steps, every index in parallel;
- otherwise recursive doubling over all ranks.
Both leave the same bytes on every rank, so the replicas' statistics stay identical.

The communicators are private duplicates: these messages never match a gradient bucket's.
Where the MPI library lets any thread call it at any time (MPI_THREAD_MULTIPLE) the training
thread sums while the synchronizer's communication thread reduces buckets. Where only one
thread at a time may (SERIALIZED), a sum first waits until the buckets handed off before it
are reduced (`before_sum`): the same order of collectives on every rank, so no rank waits in
one while another waits in a different one.
"""
import time

import numpy as np

from .collective import Collective


class BatchStatsGroup:
    """Sums over every rank of `comm`, or with a node replica (its node and cross
    communicators) through the node's shared memory first. before_sum(): called before
    each sum (the synchronizer's quiesce where MPI serializes threads). Collective to
    create and to free()."""

    def __init__(self, comm=None, node=None, before_sum=None):
        if (comm is None) == (node is None):
            raise ValueError("BatchStatsGroup: give the job's communicator or a node replica")
        self._before_sum = before_sum
        if node is None:
            self._stages = [(Collective(comm), "recursive_doubling")]
            self.size = comm.Get_size()
        else:
            self._stages = [(Collective(node.node), "hierarchical"),
                            (Collective(node.cross), "recursive_doubling")]
            self.size = node.node.Get_size() * node.cross.Get_size()
        self.seconds = 0.0       # spent summing (waits included), since take_seconds()

    def allreduce_sum(self, array):
        """`array` (1-D float64) becomes its sum over the group's ranks, in place."""
        t0 = time.perf_counter()
        if self._before_sum is not None:
            self._before_sum()
        for collective, algorithm in self._stages:
            collective.allreduce_mean(array, algorithm, threads=1)
        # The stages leave the mean over equal-sized sets of ranks; the sum is size times it.
        np.multiply(array, self.size, out=array)
        self.seconds += time.perf_counter() - t0

    def take_seconds(self):
        """Seconds spent in allreduce_sum since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def describe(self):
        """What every rank must agree on."""
        return [algorithm for _, algorithm in self._stages]

    def free(self):
        """Collective: release the communicators."""
        for collective, _ in self._stages:
            collective.free()
        self._stages = []
