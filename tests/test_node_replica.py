"""One replica per node (dist/node_replica.py): shared buffers, averaging that waits for late
ranks, and the /dev/shm check. Training with it is tested in test_dist_train.py."""
import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_average_waits_for_a_late_rank_and_parts_tile_the_buffer(ranks):
    out = run_mpi(ranks, ["tests/mpi/node_replica_check.py", "0.3"], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == ranks, out.stdout


def test_a_small_dev_shm_is_named_not_crashed_into():
    from dynar.dist import node_replica
    assert node_replica._shared_memory_room(0) is None
    assert "the shared replica needs" in node_replica._shared_memory_room(2 ** 60)
