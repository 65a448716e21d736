"""Under mpiexec -n 2: an MPI call that fails is an error naming the call and the MPI
library's words, in each way dynar calls MPI: a blocking algorithm, and MPI_Iallreduce
progressed by test() or completed by wait(). The ranks reduce buffers of different lengths,
which the library reports as truncated messages (on rank 0, whose receive is the shorter).

argv[1]: ring, test or wait. Rank 0 prints what it saw; the job then ends at once (the
other rank's reduction can never complete)."""
import os
import sys

import numpy as np

from dynar.dist import runtime
from dynar.dist.collective import Collective

MPI = runtime.mpi()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
how = sys.argv[1]
buf = np.ones(10 if rank == 0 else 1000, np.float32)
try:
    if how == "ring":
        Collective(comm).allreduce_mean(buf, "ring")
    else:
        pending = runtime.allreduce().start_mean(buf, comm)
        if how == "test":
            while not pending.test():
                pass
        else:
            pending.wait()
    outcome = "completed"
except RuntimeError as exc:
    outcome = f"raised {exc}"
if rank == 0:
    print(f"rank 0 {how}: {outcome}", flush=True)
    os._exit(0)
