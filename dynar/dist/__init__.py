"""Data-parallel training over MPI: gradient buckets reduced while backward runs.

Importing this package does not load MPI; `runtime.mpi()` does, when a job needs it.
"""
from .runtime import MPISetupError, launched_by_mpiexec

__all__ = ["MPISetupError", "launched_by_mpiexec"]
