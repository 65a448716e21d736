import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def at_thread_counts(run, counts=(1, 2)):
    """[run() with dynar's kernels on n threads for n in counts]; the thread count is
    restored afterwards."""
    from dynar.kernels import threads
    before = threads.get_num_threads()
    try:
        results = []
        for n in counts:
            threads.set_num_threads(n)
            results.append(run())
        return results
    finally:
        threads.set_num_threads(before)


def require_torch():
    """torch, or a visible skip where it is not installed (CI installs torch==2.13.0)."""
    return pytest.importorskip("torch", reason="PyTorch parity tests need `pip install torch==2.13.0`")
