"""Under mpiexec: `python -m dynar.train`, except that rank R misbehaves in global step K
(counted from 1), to check that the whole job ends with a message naming what happened.

argv: R K FAULT, then the command line's flags. FAULT is one of
  raise   the training thread raises an exception
  hang    the training thread stops for good (a rank stuck in compute)
  comm    the communication thread's allreduce raises (its gradient buckets)
  kill    the rank is SIGKILLed on the communication thread as its allreduce begins,
          while its peers wait in theirs (and its training thread is in backward)
  term    the rank sends itself SIGTERM (as Slurm would) before the step's update;
  usr1    likewise SIGUSR1 (sbatch --signal=USR1@...), int likewise SIGINT (Ctrl-C)
  nan     the rank's inputs of that step are NaN (so is its loss)
Without mpiexec, a job of one (R must be 0).
"""
import os
import signal
import sys
import time

from dynar.dist import sync
from dynar.train import cli, loop

failing_rank, failing_step, fault = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
train_step = loop.Trainer.train_step
reduce = sync.GradientSynchronizer._reduce
state = {}


def train_step_that_fails(self, x, y):
    if self.job.rank == failing_rank and self.position.global_step + 1 == failing_step:
        if fault == "raise":
            raise RuntimeError(f"injected fault at step {failing_step}")
        if fault == "hang":
            while True:
                time.sleep(60)
        if fault in ("term", "usr1", "int"):
            os.kill(os.getpid(), {"term": signal.SIGTERM, "usr1": signal.SIGUSR1,
                                  "int": signal.SIGINT}[fault])
        if fault == "nan":
            x[...] = float("nan")
        state["now"] = True
    return train_step(self, x, y)


def reduce_that_fails(self, index, threads=None):
    if state.get("now") and threads == 1:       # threads=1: on the communication thread
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "comm":
            raise RuntimeError(f"injected fault in bucket {index}'s allreduce")
    return reduce(self, index, threads)


loop.Trainer.train_step = train_step_that_fails
sync.GradientSynchronizer._reduce = reduce_that_fails
sys.exit(cli.main(sys.argv[4:]))
