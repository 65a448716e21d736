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


THREAD_ENV = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")


@pytest.mark.parametrize("env, ranks_on_node, expected", [
    ({"OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": "2"}, 1, (1, "OMP_NUM_THREADS=1")),
    ({"OMP_NUM_THREADS": "1,4"}, 2, (1, "OMP_NUM_THREADS=1")),      # OpenMP's nested form
    ({"SLURM_CPUS_PER_TASK": "1"}, 1, (1, "SLURM_CPUS_PER_TASK=1")),
    ({"OMP_NUM_THREADS": ""}, 1, None),                            # empty is unset
    ({}, 2, None)])
def test_job_threads_come_from_the_launcher_else_the_node_share(monkeypatch, env,
                                                                ranks_on_node, expected):
    from dynar.dist.job import Job
    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = Job()
    job.local_size = ranks_on_node
    cores, allowed = os.cpu_count(), len(os.sched_getaffinity(0))
    if expected is None:
        share = max(1, cores // ranks_on_node)
        expected = (share, f"{cores} cores / {ranks_on_node} rank(s) on this node") \
            if share <= allowed else (allowed, f"the {allowed} CPU(s) this rank is bound to")
    assert job.default_threads() == expected


def test_job_threads_never_exceed_the_cpus_a_rank_may_run_on(monkeypatch):
    from dynar.dist.job import Job
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    allowed = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(allowed + 3))
    assert Job().default_threads() == (
        allowed, f"SLURM_CPUS_PER_TASK={allowed + 3}, capped to the {allowed} CPU(s) this "
                 f"rank may run on")


@pytest.mark.parametrize("value", ["x", "0", "-2", "2.5"])
def test_job_threads_refuse_a_malformed_setting(monkeypatch, value):
    from dynar.dist.job import Job
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", value)
    with pytest.raises(ValueError, match=f"SLURM_CPUS_PER_TASK='{value}': expected a whole"):
        Job().default_threads()


def test_start_line_says_where_the_thread_count_came_from():
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env["SLURM_CPUS_PER_TASK"] = "1"
    out = subprocess.run([sys.executable, "-m", "dynar.train", "--max-steps", "1",
                          "--eval-every", "0"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 rank(s) x 1 thread(s) (SLURM_CPUS_PER_TASK=1)" in out.stdout
