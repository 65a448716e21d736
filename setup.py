"""Build the Cython sources in pyx/ into extension modules inside dynar/.

Environment:
  DYNAR_PORTABLE=1   build without -march=native / -mcpu=native (wheels that move between machines)
  DYNAR_DEBUG=1      -O0 -g and Cython bounds checks, for gdb/valgrind sessions
"""
import os
import platform

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# pyx source stem -> importable module name. One module per concept.
MODULES = {
    "threads": "dynar.kernels.threads",
    "conv": "dynar.kernels.conv",
    "pool": "dynar.kernels.pool",
    "activation": "dynar.kernels.activation",
    "linear": "dynar.kernels.linear",
    "batchnorm": "dynar.kernels.batchnorm",
    "loss": "dynar.kernels.loss",
    "sgd": "dynar.kernels.sgd",
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


def _extensions():
    debug = os.environ.get("DYNAR_DEBUG", "0") not in ("", "0")
    opt = ["-O0", "-g"] if debug else ["-O3"]
    compile_args = opt + ["-fopenmp", "-Wno-unused-function", "-Wno-unreachable-code"] + _arch_flags()
    exts = []
    for stem, name in MODULES.items():
        if not os.path.exists(os.path.join(HERE, "pyx", stem + ".pyx")):  # TODO(bootstrap): remove
            continue
        exts.append(Extension(
            name,
            sources=[os.path.join("pyx", stem + ".pyx")],
            include_dirs=[numpy.get_include(), os.path.join(HERE, "include"), os.path.join(HERE, "pyx")],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=compile_args,
            extra_link_args=["-fopenmp"],
        ))
    directives = dict(language_level=3, boundscheck=debug, wraparound=False, cdivision=True,
                      initializedcheck=debug, embedsignature=True)
    return cythonize(exts, compiler_directives=directives, include_path=["pyx"],
                     nthreads=int(os.environ.get("DYNAR_BUILD_JOBS", "0")) or None)


setup(ext_modules=_extensions())
