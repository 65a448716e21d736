"""Under mpiexec: BatchStatsGroup sums over every rank, through the node's shared memory
(NodeReplica's communicators) or over all ranks, leaving the same bytes on every rank, and
while another thread is reducing a large buffer of its own.

EMULATED_NODES=k splits the ranks into k "nodes" (DYNAR_NODE_KEY) of consecutive ranks."""
import hashlib
import os
import threading
import types

import numpy as np

from dynar.dist import runtime
from dynar.dist.batch_stats import BatchStatsGroup
from dynar.dist.collective import Collective

MPI = runtime.mpi()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
nodes = int(os.environ.get("EMULATED_NODES", "1"))
os.environ["DYNAR_NODE_KEY"] = str(rank * nodes // size)
from dynar.dist import node_replica   # noqa: E402 - after the node key is set

node, cross = node_replica.split(comm)
groups = {"all ranks": BatchStatsGroup(comm=comm),
          "node replica": BatchStatsGroup(node=types.SimpleNamespace(node=node, cross=cross))}
# Gradient buckets reduced on another thread meanwhile (MPI_THREAD_MULTIPLE here).
gradients = Collective(comm)
bucket = np.ones(1 << 20, np.float32)
busy = threading.Thread(target=lambda: [gradients.allreduce_mean(bucket, "ring", threads=1)
                                        for _ in range(20)])
busy.start()
for name, group in groups.items():
    for n in (1, 65, 2 * 512 + 1):
        mine = np.random.default_rng([rank, n]).standard_normal(n)
        everyone = np.array(comm.allgather(mine))
        total = mine.copy()
        group.allreduce_sum(total)
        np.testing.assert_allclose(total, everyone.sum(axis=0), rtol=1e-12, atol=1e-12,
                                   err_msg=f"{name}, {n} values")
        digests = comm.allgather(hashlib.sha256(total.tobytes()).hexdigest())
        assert len(set(digests)) == 1, f"{name}, {n} values: ranks hold different sums"
    assert group.take_seconds() > 0 and group.take_seconds() == 0
busy.join()
assert (bucket == 1).all()
for group in groups.values():
    group.free()
gradients.free()
print(f"rank {rank} ok, node {node.Get_rank()} of {node.Get_size()}, "
      f"{cross.Get_size()} node(s), thread level {MPI.Query_thread()}", flush=True)
