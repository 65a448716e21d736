import numpy as np
import pytest

from dynar.dist import runtime
from mpirun import launcher_is_hydra, run_mpi


@pytest.mark.parametrize("ranks, nodes", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2),
                                          (5, 2), (8, 2)])
def test_every_algorithm_matches_mpi_allreduce_and_is_identical_on_all_ranks(ranks, nodes):
    # nodes > 1: the hierarchical algorithm over emulated nodes (ranks dealt round-robin;
    # 3 ranks on 2 nodes leave one node a single rank).
    out = run_mpi(ranks, ["tests/mpi/algorithms_check.py", str(nodes)], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == ranks, out.stdout


@pytest.mark.parametrize("how, call", [("ring", "allreduce (algorithm id 1) of 10 elements"),
                                       ("test", "MPI_Testall failed"),
                                       ("wait", "MPI_Waitall failed")])
def test_a_failing_mpi_call_is_an_error_naming_it(how, call):
    # Each progress mode: the blocking algorithms (communication thread, per-layer) and
    # MPI_Iallreduce driven by test() between layers or finished by wait().
    if how != "ring" and launcher_is_hydra():
        pytest.skip("MPICH completes an MPI_Iallreduce of mismatched lengths without an "
                    "error: the way this test makes the call fail does not fail there")
    out = run_mpi(2, ["tests/mpi/mpi_errors.py", how], timeout=60)
    line = next((l for l in out.stdout.splitlines() if l.startswith("rank 0")), out.stdout)
    assert line.startswith(f"rank 0 {how}: raised") and call in line, out.stdout + out.stderr
    assert "(MPI error code " in line, line           # after the library's own words


@pytest.mark.mpi   # loads dynar's MPI extension, and so MPI, into the test process
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


@pytest.mark.mpi   # loads dynar's MPI extension into the test process
@pytest.mark.parametrize("wire, largest, beyond", [("fp16", 65504.0, 7e4),
                                                   ("bf16", 3.3895313892515355e38, 3.4e38)])
def test_error_feedback_saturates_and_stays_finite(wire, largest, beyond):
    # A value beyond the format's range was sent as inf, leaving the residual -inf and every
    # later step NaN. Now it is sent as the largest finite value, the rest carried over.
    try:
        runtime.allreduce()
    except runtime.MPISetupError as exc:
        pytest.skip(str(exc))
    from dynar.dist.collective import compress_with_feedback
    grad = np.array([beyond, -beyond, 1.0], np.float32)
    residual = np.zeros(3, np.float32)
    compress_with_feedback(grad, residual, wire)
    np.testing.assert_array_equal(grad, np.array([largest, -largest, 1.0], np.float32))
    excess = float(np.float32(beyond)) - float(np.float32(largest))
    np.testing.assert_allclose(residual, [excess, -excess, 0.0], rtol=1e-6)
    for _ in range(3):                      # the excess drains over the next steps, finitely
        grad = np.ones(3, np.float32)
        compress_with_feedback(grad, residual, wire)
        assert np.isfinite(grad).all() and np.isfinite(residual).all(), (grad, residual)
    # A non-finite value goes out as it is (the step's check sees it); the residual survives.
    before = residual.copy()
    grad = np.array([np.inf, np.nan, 1.0], np.float32)
    compress_with_feedback(grad, residual, wire)
    assert np.isposinf(grad[0]) and np.isnan(grad[1])
    np.testing.assert_array_equal(residual[:2], before[:2])
