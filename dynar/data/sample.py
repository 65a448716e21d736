"""`mnist-sample`: 5,000 real MNIST digits (500 of each class) that ship inside dynar, so
that `python -m dynar.train` trains on real data with no download and no extra package.

The digits are package data (`mnist_sample/`, two gzipped IDX files, ~0.8 MB; their source
and attribution are in mnist_sample/README.md), read by the same IDX reader as a user's
MNIST files. The 4,000/1,000 train/held-out split is stratified and fixed.
"""
import os

import numpy as np

from . import mnist
from .dataset import DataError, Dataset

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mnist_sample")
IMAGES, LABELS = "images-idx3-ubyte.gz", "labels-idx1-ubyte.gz"
TEST_PER_CLASS = 100  # 4,000 train / 1,000 held out, stratified
# Fixed, independent of the training seed: the held-out digits never change between runs,
# so accuracies from different runs compare.
SPLIT_SEED = 20240


def load(folder=FOLDER):
    """The 4,000/1,000 mnist-sample split from the IDX files in `folder` (default: dynar's)."""
    images = mnist.read_idx(os.path.join(folder, IMAGES), ndim=3)
    labels = mnist.read_idx(os.path.join(folder, LABELS), ndim=1).astype(np.int64)
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise DataError(f"{folder}: expected 28x28 images and one label each, got images "
                        f"{images.shape} and {len(labels)} labels")
    if labels.size == 0 or labels.max() > 9:
        raise DataError(f"{os.path.join(folder, LABELS)}: labels must be 0-9")
    rng = np.random.default_rng(SPLIT_SEED)
    held_out = np.zeros(len(labels), bool)
    for c in range(10):
        held_out[rng.permutation(np.flatnonzero(labels == c))[:TEST_PER_CLASS]] = True
    train, test = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    images = images[:, None]
    mean, std = mnist.STATS["mnist"]
    return Dataset(name="mnist-sample", x_train=images[train], y_train=labels[train],
                   x_test=images[test], y_test=labels[test], num_classes=10,
                   mean=(mean,), std=(std,))
