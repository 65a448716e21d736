"""MPI program run on the emulated cluster: times MPI_Allreduce (mpi4py, float32, SUM) and
reports how the ranks see the node layout.

    python -m mpi4py -m perf.cluster.allreduce_probe NBYTES WARMUP REPEATS

Rank 0 prints one JSON line: the median time per rank (each repetition starts after a
barrier), the slowest rank's median (the figure that counts: an allreduce ends when its
last rank ends), and for every rank its hostname, the size of its
MPI_Comm_split_type(COMM_TYPE_SHARED) communicator and its DYNAR_NODE_KEY.
"""
import json
import os
import socket
import statistics
import sys
import time


def main(nbytes, warmup, repeats):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    layout = comm.gather({"rank": comm.Get_rank(), "hostname": socket.gethostname(),
                          "shared_size": shared.Get_size(),
                          "node_key": os.environ.get("DYNAR_NODE_KEY")})
    shared.Free()
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    for _ in range(warmup):
        comm.Allreduce(send, recv, op=MPI.SUM)
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        samples.append(time.perf_counter() - start)
    if recv[0] != comm.Get_size() or recv[-1] != comm.Get_size():
        raise AssertionError(f"allreduce gave {recv[0]}, expected {comm.Get_size()}")
    medians = comm.gather(statistics.median(samples))
    all_samples = comm.gather(samples)
    if comm.Get_rank() == 0:
        print(json.dumps({"bytes": send.nbytes, "ranks": comm.Get_size(),
                          "time_s": max(medians), "median_per_rank_s": medians,
                          "samples_s": all_samples, "layout": layout}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*(int(a) for a in sys.argv[1:]))
