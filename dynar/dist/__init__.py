"""Data-parallel training over MPI: gradient buckets reduced while backward runs.

DataParallel (data_parallel.py) is the way in; Job (job.py) is this process's place in the
job. Importing this package does not load MPI; `runtime.mpi()` does, when a job needs it.
"""
from .data_parallel import DataParallel, NonFiniteError, StepReport, SyncConfig
from .job import Job
from .runtime import MPISetupError, launched_by_mpiexec

__all__ = ["DataParallel", "Job", "MPISetupError", "NonFiniteError", "StepReport",
           "SyncConfig", "launched_by_mpiexec"]
