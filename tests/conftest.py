import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def require_torch():
    """torch, or a visible skip where it is not installed (CI installs torch==2.13.0)."""
    return pytest.importorskip("torch", reason="PyTorch parity tests need `pip install torch==2.13.0`")
