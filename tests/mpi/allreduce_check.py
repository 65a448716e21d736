"""Under mpiexec: dynar's allreduce against MPI_Allreduce, and identical bytes on all ranks."""
import numpy as np

from dynar.dist import runtime

MPI = runtime.mpi()
allreduce = runtime.allreduce()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
for n in sorted({0, 1, max(size - 1, 0), size + 1, (1 << 20) + 3}):
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(1000 * rank + n).standard_normal(n).astype(dtype)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected, op=MPI.SUM)
        expected /= size
        mean = x.copy()
        pending = allreduce.start_mean(mean, comm)
        while not pending.test():
            pass
        # Sum then scale: float32 rounding of the scaled value only (a few ulps).
        np.testing.assert_allclose(mean, expected, rtol=1e-6 if dtype == np.float32 else 1e-14,
                                   atol=0, err_msg=f"n={n} {dtype.__name__}")
        blocking = x.copy()
        allreduce.allreduce_mean(blocking, comm)
        assert np.array_equal(blocking, mean), f"n={n}: blocking and nonblocking differ"
        digests = comm.allgather(mean.tobytes())
        assert all(d == digests[0] for d in digests), f"n={n}: ranks hold different bytes"
print(f"rank {rank}/{size} ok", flush=True)
