"""Helpers of the tests that build an emulated cluster (test_cluster.py) or a Slurm cluster
on it (test_slurm.py): skipping where they cannot run, the perf.cluster command line, and
checking that a killed owner's cluster is really gone."""
import os
import subprocess
import sys
import time

import pytest

from perf import cluster
from perf.cluster import network
from support.markers import expect_marker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def builds_a_cluster(test):
    """Marks a test that builds an emulated cluster: its network namespaces and shaped links
    need root, and its hosts run MPI ranks."""
    return pytest.mark.root(pytest.mark.mpi(test))


def require_namespaces():
    expect_marker("root", "builds network namespaces")
    ok, reason = cluster.available()
    if not ok:
        pytest.skip(f"emulated cluster unavailable: {reason}")


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "perf.cluster", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def start_owner(script, processes, timeout=30):
    """A process running `script`, which builds a cluster, prints a line starting with its
    run id and then keeps it busy: (process, the words of that line, pids inside the
    namespaces), once there are `processes` of them."""
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    words = owner.stdout.readline().split()
    run_id = words[0] if words else None
    if not run_id:
        owner.kill()
        pytest.fail("the owner process did not start a cluster")
    namespaces = [f"dynar-{run_id}-h{i}" for i in range(2)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for ns in namespaces for p in network.pids_in(ns)]
        if len(pids) >= processes:
            return owner, words, pids
        time.sleep(0.1)
    owner.kill()
    pytest.fail(f"fewer than {processes} processes started on the emulated hosts")


def assert_gone(run_id, pids):
    """Nothing of run `run_id` is left: no kernel object, no run directory, none of `pids`
    alive (a zombie waiting for its parent's wait counts as gone)."""
    assert run_id not in cluster.leftovers()
    assert not os.path.exists(f"/tmp/dynar-cluster-{run_id}")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "Z", f"process {pid} survived"
        except FileNotFoundError:
            pass
