"""`synthetic`: seeded N(0, 1) float32 inputs with uniform random labels.

For benchmarks and smoke tests (the peer protocol uses N(0, 1) inputs); nothing can be
learned from it, and the dataset says so (name "synthetic", .synthetic = True).
"""
import numpy as np

from .dataset import Dataset

MAX_TRAIN = 4096
MIN_TRAIN = 256  # enough for one step at the largest batch the benchmarks use
BUDGET_BYTES = 256 << 20  # 3x224x224 inputs are 600 kB each: cap the memory, not the count


def load(input_shape, num_classes, seed=0):
    """Synthetic dataset of (C, H, W) = input_shape samples over num_classes labels."""
    c, h, w = (int(d) for d in input_shape)
    if min(c, h, w) < 1 or num_classes < 1:
        raise ValueError(f"synthetic: need a positive input shape and num_classes, got "
                         f"{input_shape}, {num_classes}")
    n_train = int(np.clip(BUDGET_BYTES // (4 * c * h * w), MIN_TRAIN, MAX_TRAIN))
    n_test = n_train // 4
    rng = np.random.default_rng(seed)

    def split(n):
        x = rng.standard_normal((n, c, h, w), dtype=np.float32)
        return x, rng.integers(0, num_classes, n, dtype=np.int64)

    (x_train, y_train), (x_test, y_test) = split(n_train), split(n_test)
    return Dataset(name="synthetic", x_train=x_train, y_train=y_train, x_test=x_test,
                   y_test=y_test, num_classes=int(num_classes), mean=(0.0,) * c, std=(1.0,) * c,
                   synthetic=True)
