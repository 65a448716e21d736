"""Which MPI library dynar runs on (dist/runtime.py): the extension built against one MPI is
refused beside another implementation or major version, with the rebuild command; a task
of an srun step that came up as an MPI job of one is refused, naming the --mpi plugin."""
import os
import subprocess
import sys

import pytest

from mpirun import ROOT

from dynar.dist import runtime

OPEN_MPI_5 = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: "
              "5.0.11, repo rev: v5.0.11rc1, Sep 16, 2026\x00")
MPICH_4 = "MPICH Version:      4.0.2\nMPICH Release date: Thu May  5 10:53:25 CDT 2022\n"
INTEL = "Intel(R) MPI Library 2021.6 for Linux* OS\n"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"


@pytest.mark.parametrize("text, expected", [
    (OPEN_MPI_5, ("Open MPI", (5, 0, 11))), (MPICH_4, ("MPICH", (4, 0, 2))),
    (INTEL, ("Intel MPI", (2021, 6, 0))), (MVAPICH, ("MVAPICH", (2, 3, 7))),
    ("Some MPI 1.0", ("unknown", None))])
def test_library_version_is_read_from_the_library_text(text, expected):
    assert runtime.library_version(text) == expected


@pytest.mark.parametrize("vendor, version, text", [
    ("Open MPI", "5.0.3", OPEN_MPI_5),       # another bug-fix release of the same series
    ("MPICH", "4.1", MPICH_4),
    ("Intel MPI", "2021.9.0", INTEL),
    ("unknown", "unknown", MPICH_4),          # a header dynar does not know: nothing to compare
    ("Open MPI", "5.0.11", "Some MPI 1.0")])
def test_same_library_and_major_version_is_accepted(vendor, version, text):
    runtime.check_same_library(vendor, version, text)


@pytest.mark.parametrize("vendor, version, text, loaded", [
    ("MPICH", "4.0.2", OPEN_MPI_5, "Open MPI 5.0.11"),
    ("Open MPI", "4.1.6", OPEN_MPI_5, "Open MPI 5.0.11"),
    ("MPICH", "3.4.3", MPICH_4, "MPICH 4.0.2")])
def test_another_library_or_major_version_is_refused_with_the_fix(vendor, version, text, loaded):
    with pytest.raises(runtime.MPISetupError) as info:
        runtime.check_same_library(vendor, version, text)
    message = str(info.value)
    assert f"built against {vendor} {version} but mpi4py loaded {loaded}" in message
    assert "pip install --no-build-isolation" in message and "\n" not in message


@pytest.mark.mpi
def test_a_task_of_a_bigger_srun_step_alone_in_its_mpi_job_is_refused():
    # What `srun --mpi=none -n 2` gives an MPI that needs PMIx: each task a singleton.
    env = dict(os.environ, SLURM_STEP_NUM_TASKS="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run([sys.executable, "-m", "dynar.train", "--max-steps", "1"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "srun started 2 tasks but each is an MPI job of one" in done.stderr
    assert "--mpi=pmix" in done.stderr and "Traceback" not in done.stderr
