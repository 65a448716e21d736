import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_allreduce_matches_mpi_allreduce_and_is_identical_on_all_ranks(ranks):
    out = run_mpi(ranks, ["tests/mpi/allreduce_check.py"], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == ranks, out.stdout
