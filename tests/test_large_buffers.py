"""Kernels index with 64-bit arithmetic: a buffer past 2^31 elements is processed to its end."""
import numpy as np
import pytest

from dynar.kernels import activation, pool

H, W = 32769, 65536          # one plane of 2^31 + 2^16 float32 elements (8.6 GB)


def _available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow   # ~30 s on 2 cores: filling and reading an 8.6 GB buffer
@pytest.mark.skipif(_available_bytes() < 12 * 2 ** 30,
                    reason="needs 12 GB of free memory for an 8.6 GB buffer")
def test_elementwise_and_pooling_reach_past_2_to_the_31():
    x = np.full((1, 1, H, W), 2.0, np.float32)
    beyond = 2 ** 31 + 12345          # flat index past the int32 range
    flat = x.reshape(-1)
    flat[beyond] = -7.0
    flat[-1] = -5.0
    activation.relu_forward(x, x)     # in place
    assert flat[beyond] == 0.0 and flat[-1] == 0.0 and flat[beyond - 1] == 2.0
    mean = np.empty((1, 1), np.float32)
    pool.global_avgpool_forward(mean, x)
    expected = 2.0 * (H * W - 2) / (H * W)
    assert abs(float(mean[0, 0]) - expected) < 1e-3
