import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("ranks, nodes", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2),
                                          (5, 2), (8, 2)])
def test_every_algorithm_matches_mpi_allreduce_and_is_identical_on_all_ranks(ranks, nodes):
    # nodes > 1: the hierarchical algorithm over emulated nodes (ranks dealt round-robin;
    # 3 ranks on 2 nodes leave one node a single rank).
    out = run_mpi(ranks, ["tests/mpi/algorithms_check.py", str(nodes)], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == ranks, out.stdout
