import numpy as np
import pytest

from dynar.dist import runtime
from mpirun import run_mpi


@pytest.mark.parametrize("ranks, nodes", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2),
                                          (5, 2), (8, 2)])
def test_every_algorithm_matches_mpi_allreduce_and_is_identical_on_all_ranks(ranks, nodes):
    # nodes > 1: the hierarchical algorithm over emulated nodes (ranks dealt round-robin;
    # 3 ranks on 2 nodes leave one node a single rank).
    out = run_mpi(ranks, ["tests/mpi/algorithms_check.py", str(nodes)], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == ranks, out.stdout


@pytest.mark.parametrize("n, sources, threads", [(0, 2, 1), (5, 1, 1), (4097, 2, 1),
                                                 (300001, 4, 2), (10, 0, 1)])
def test_mean_into_sums_in_order_then_scales(n, sources, threads):
    # The node replica's averaging: out = (out + others...) * factor, one pass, in place.
    try:
        ar = runtime.allreduce()
    except runtime.MPISetupError as exc:     # built with DYNAR_NO_MPI=1, or no mpi4py
        pytest.skip(str(exc))
    rng = np.random.default_rng(n + sources)
    out = rng.standard_normal(n).astype(np.float32)
    others = [rng.standard_normal(n).astype(np.float32) for _ in range(sources)]
    expected = out.copy()
    for o in others:
        expected += o
    expected *= np.float32(0.25)
    ar.mean_into(out, others, 0.25, threads)
    np.testing.assert_array_equal(out, expected)      # same order, same float32 roundings
    with pytest.raises(ValueError, match=r"others\[0\]: expected 3 elements"):
        ar.mean_into(np.zeros(3, np.float32), [np.zeros(4, np.float32)], 1.0)
