"""Comparing two training runs by their last checkpoints."""
import numpy as np

from dynar import checkpoint


def assert_bitwise_same_run(folder_a, folder_b):
    """The runs that wrote these checkpoint folders ended at the same step with the same
    weights, momentum and random state, bit for bit; returns that step."""
    a, b = checkpoint.load(folder_a / "last.ckpt"), checkpoint.load(folder_b / "last.ckpt")
    assert a["global_step"] == b["global_step"]
    for name in a["model"]:
        assert np.array_equal(a["model"][name], b["model"][name]), name
    assert np.array_equal(a["optimizer"]["momentum_buffer"], b["optimizer"]["momentum_buffer"])
    assert a["generator"] == b["generator"]
    return a["global_step"]
