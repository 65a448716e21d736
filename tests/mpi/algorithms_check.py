"""Under mpiexec: every allreduce algorithm against MPI_Allreduce, identical bytes on all ranks.

argv[1] (optional): number of emulated nodes for the hierarchical algorithm (ranks are dealt
to nodes round-robin through Collective's node_key, so node-local ranks are not contiguous).
"""
import sys

import numpy as np

from dynar.dist import runtime
from dynar.dist.algorithms import ALGORITHMS
from dynar.dist.collective import Collective

MPI = runtime.mpi()
ar = runtime.allreduce()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
collective = Collective(comm, reduce_threads=2, node_key=rank % nodes if nodes > 1 else None)
assert collective.nodes == (min(nodes, size) if nodes > 1 else 1), collective.nodes

counts = sorted({0, 1, max(size - 1, 0), size, size + 1, 1000003, (1 << 20) + 3})
for n in counts:
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(1000 * rank + n).standard_normal(n).astype(dtype)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected, op=MPI.SUM)
        expected /= size
        for algorithm in ALGORITHMS:
            mean = x.copy()
            collective.allreduce_mean(mean, algorithm)
            where = f"{algorithm} n={n} {dtype.__name__} p={size}"
            # Different summation orders: float32 rounding of sums of `size` terms.
            tol = 1e-5 if dtype == np.float32 else 1e-13
            np.testing.assert_allclose(mean, expected, rtol=tol, atol=tol, err_msg=where)
            digests = comm.allgather(mean.tobytes())
            assert all(d == digests[0] for d in digests), f"{where}: ranks hold different bytes"
        posted = x.copy()
        pending = ar.start_mean(posted, comm)     # MPI_Iallreduce, progressed by test()
        while not pending.test():
            pass
        np.testing.assert_allclose(posted, expected, rtol=tol, atol=tol, err_msg=f"start_mean n={n}")
        digests = comm.allgather(posted.tobytes())
        assert all(d == digests[0] for d in digests), f"start_mean n={n}: ranks hold different bytes"
    for wire, tol in (("fp16", 2e-3), ("bf16", 2e-2)):
        x = np.random.default_rng(7 * rank + n).standard_normal(n).astype(np.float32)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected, op=MPI.SUM)
        expected /= size
        mean = x.copy()
        collective.allreduce_mean(mean, "ring", wire=wire)
        # Each partial sum is rounded to the wire format: relative error ~ p * 2^-11 (fp16).
        scale = np.abs(expected).max() if n else 1.0
        np.testing.assert_allclose(mean, expected, rtol=0, atol=tol * size * scale,
                                   err_msg=f"ring wire={wire} n={n}")
        digests = comm.allgather(mean.tobytes())
        assert all(d == digests[0] for d in digests), f"wire={wire} n={n}: bytes differ"

# Near the top of fp16's range (65504) every partial sum of two or more ranks leaves it; the
# running means the wire ring carries do not: 60000 is exact in fp16, and so is the mean.
for wire in ("fp16", "bf16"):
    near_top = np.full(1000, 60000.0 * (1 if rank % 2 else -1) if size > 2 else 60000.0,
                       np.float32)
    expected = np.empty_like(near_top)
    comm.Allreduce(near_top, expected, op=MPI.SUM)
    expected /= size
    collective.allreduce_mean(near_top, "ring", wire=wire)
    np.testing.assert_allclose(near_top, expected, rtol=2e-2 if wire == "bf16" else 1e-3,
                               atol=60000 * 2e-3, err_msg=f"ring wire={wire} near its range")


def rejects(call, error, words):
    try:
        call()
    except error as exc:
        assert words in str(exc), str(exc)
    else:
        raise AssertionError(f"no {error.__name__} mentioning {words!r}")


buf = np.zeros(8, np.float32)
rejects(lambda: collective.allreduce_mean(buf, "tree"), ValueError, "unknown allreduce algorithm")
rejects(lambda: collective.allreduce_mean(buf, "mpi", wire="fp16"), ValueError, "needs the ring algorithm")
rejects(lambda: collective.allreduce_mean(buf, "ring", wire="fp8"), ValueError, "unknown wire format")
rejects(lambda: collective.allreduce_mean(buf.astype(np.int32)), TypeError, "buf")
rejects(lambda: collective.allreduce_mean(np.zeros((2, 4), np.float32)), ValueError, "buf")
rejects(lambda: collective._ext.allreduce_mean(buf, 99), ValueError, "no allreduce algorithm has id")
collective.free()
print(f"rank {rank}/{size} ok", flush=True)
