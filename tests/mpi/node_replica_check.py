"""Under mpiexec, all ranks on one node: NodeReplica shares parameters and gradients, and
average() waits for every rank's gradient even when one rank writes it late.

argv[1]: seconds the last rank sleeps before writing its gradient each round."""
import sys
import time

import numpy as np

from dynar import nn
from dynar.dist import runtime
from dynar.dist.node_replica import NodeReplica

MPI = runtime.mpi()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
delay = float(sys.argv[1])

net = nn.Sequential(nn.Linear(300, 50, generator=np.random.default_rng(rank)),
                    nn.Linear(50, 7, generator=np.random.default_rng(rank))).flatten_parameters()
n = net.flat_params.size
node = NodeReplica(net, None, comm)
node.broadcast_parameters()                   # rank 0's initial parameters everywhere
rank0 = nn.Linear(300, 50, generator=np.random.default_rng(0))
assert np.array_equal(net[0].weight.data, rank0.weight.data)

buckets = [(0, 10), (10, 357), (357, n)]     # uneven, one smaller than the rank count
for round_ in range(3):
    if rank == size - 1:
        time.sleep(delay)                     # everyone else reaches average() first
    values = np.arange(n, dtype=np.float32) * (rank + 1) + round_
    net.flat_grads[:] = values
    parts = [node.average(start, stop) for start, stop in buckets]
    mean = np.arange(n, dtype=np.float32) * np.float32((size + 1) / 2) + round_
    for lo, hi in parts:
        np.testing.assert_allclose(net.flat_grads[lo:hi], mean[lo:hi], rtol=1e-6,
                                   err_msg=f"rank {rank} round {round_} part {lo}:{hi}")
    covered = comm.allgather(node.take_averaged())
    cover = np.zeros(n, np.int64)
    for ranges in covered:
        for lo, hi in ranges:
            cover[lo:hi] += 1
    assert (cover == 1).all(), "the ranks' parts must tile the buffer exactly once"
    node.barrier()                            # the step's end: nobody rewrites a gradient early

if rank == 0:
    net.flat_params[:] = 3.0                  # one copy on the node
node.barrier()
assert (net.flat_params == 3.0).all(), f"rank {rank} does not see the shared parameters"
node.close()
assert (net.flat_params == 3.0).all() and net[0].weight.data.base is not None
net.flat_params[:] = rank                     # private again after close()
comm.Barrier()
assert (net.flat_params == rank).all()
print(f"rank {rank} ok", flush=True)
