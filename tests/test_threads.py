"""Thread count and floating-point mode of the compute core."""
import os
import subprocess
import sys

import numpy as np
import pytest

from dynar.kernels import threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _default_threads(env):
    code = "from dynar.kernels import threads; print(threads.get_num_threads())"
    full = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=full, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_default_respects_omp_num_threads_and_affinity():
    cpus = len(os.sched_getaffinity(0))
    assert _default_threads({}) == cpus
    assert _default_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert _default_threads({"OMP_NUM_THREADS": str(cpus + 7)}) == cpus
    if cpus >= 2:   # a process pinned to one core gets one thread
        code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                "from dynar.kernels import threads; print(threads.get_num_threads())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=ROOT, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
        assert int(out.stdout) == 1, out.stderr


def test_set_num_threads_validates_and_applies():
    before = threads.get_num_threads()
    try:
        threads.set_num_threads(3)
        assert threads.get_num_threads() == 3
    finally:
        threads.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        threads.set_num_threads(0)
    with pytest.raises(TypeError, match="threads"):
        threads.set_num_threads(2.0)


def test_flush_denormals_turns_subnormals_into_zero():
    tiny = np.array([1e-40], np.float32)         # subnormal in float32
    try:
        assert threads.set_flush_denormals(True)
        assert threads.flush_denormals_enabled()
        assert (tiny * np.float32(1.0))[0] == 0.0    # DAZ: the input reads as zero
    finally:
        threads.set_flush_denormals(False)
    assert not threads.flush_denormals_enabled()
    assert (tiny * np.float32(1.0))[0] != 0.0
