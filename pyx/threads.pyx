"""Thread count and floating-point mode of the compute core.

Every kernel parallelizes with OpenMP (`prange` over images or channels) and calls BLAS with
one thread from inside those regions, so the OpenMP thread count is the only knob: it is the
number of cores dynar computes on. The default respects OMP_NUM_THREADS and the process's CPU
affinity (a rank pinned to 4 cores of a 64-core node gets 4 threads, not 64).
"""
import os

from cython.parallel cimport parallel
cimport openmp

cdef extern from "fpmode.h" nogil:
    int dynar_set_flush_denormals(int on)
    int dynar_get_flush_denormals()

cdef bint _flush_denormals = False


def default_num_threads():
    """min(OMP_NUM_THREADS if set, CPUs in this process's affinity mask)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env:
        try:
            requested = int(env)
        except ValueError:
            requested = 0
        if requested >= 1:
            return min(requested, cpus) if cpus >= 1 else requested
    return max(cpus, 1)


def get_num_threads():
    """Threads the kernels use."""
    return openmp.omp_get_max_threads()


def set_num_threads(n):
    """Use `n` threads in every kernel from now on (n >= 1)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"threads: expected an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"threads: must be >= 1, got {n}")
    openmp.omp_set_num_threads(n)
    # New pool threads start with the default FP mode; re-apply ours to all of them.
    _apply_fp_mode(_flush_denormals)


cdef bint _apply_fp_mode(bint on) noexcept:
    # The FP control register is per thread: set it in the calling (Python) thread and in
    # every OpenMP worker, which persist between parallel regions.
    with nogil, parallel():
        dynar_set_flush_denormals(on)
    return dynar_set_flush_denormals(on)


def set_flush_denormals(bint on):
    """Flush subnormal floats to zero (FTZ+DAZ) in every compute thread.

    Training enables it: subnormal arithmetic runs 5-100x slower on x86 and ARM cores and
    changes no result that matters. Returns False where the platform has no such mode."""
    global _flush_denormals
    _flush_denormals = on
    return bool(_apply_fp_mode(on))


def flush_denormals_enabled():
    """Whether the calling thread currently flushes subnormals to zero."""
    return bool(dynar_get_flush_denormals())


openmp.omp_set_num_threads(default_num_threads())
