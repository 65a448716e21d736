"""MNIST and Fashion-MNIST from their IDX files (raw or gzipped).

IDX layout (big-endian): 2 zero bytes, a type byte (0x08 = ubyte), the number of
dimensions, one uint32 per dimension, then the data. Images are idx3 (N, 28, 28), labels
idx1 (N,). The header is read first and only the data it declares is read (inflated) after
it: a gzip that would inflate to more fails at once, in bounded memory.
"""
import gzip
import math
import os
import zlib

import numpy as np

from ..bounded_read import DeclaredSizeError, check_fits, check_inflation, read_into
from .dataset import DataError, Dataset

SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# Per-pixel mean/std of the training set, the values torchvision's examples use.
STATS = {
    "mnist": (0.1307, 0.3081),
    "fashion-mnist": (0.2860, 0.3530),
}

# Sub-directories of --data-dir also searched, so the usual download layouts work as-is.
SUBDIRS = {
    "mnist": ("mnist", os.path.join("MNIST", "raw")),
    "fashion-mnist": ("fashion-mnist", os.path.join("FashionMNIST", "raw")),
}


def load(name, data_dir):
    """Dataset `name` ("mnist" or "fashion-mnist") from the IDX files under data_dir."""
    folder = _find_folder(name, data_dir)
    arrays = {}
    for split, (images_stem, labels_stem) in SPLITS.items():
        images = read_idx(_resolve(folder, images_stem), ndim=3)
        labels = read_idx(_resolve(folder, labels_stem), ndim=1)
        if images.shape[0] != labels.shape[0]:
            raise DataError(f"{_resolve(folder, labels_stem)}: {labels.shape[0]} labels but "
                            f"{images.shape[0]} images in {_resolve(folder, images_stem)}")
        if labels.size and labels.max() > 9:
            raise DataError(f"{_resolve(folder, labels_stem)}: label {labels.max()} out of range 0-9")
        arrays[split] = (np.ascontiguousarray(images[:, None]), labels.astype(np.int64))
    mean, std = STATS[name]
    return Dataset(name=name, x_train=arrays["train"][0], y_train=arrays["train"][1],
                   x_test=arrays["test"][0], y_test=arrays["test"][1], num_classes=10,
                   mean=(mean,), std=(std,))


def read_idx(path, ndim):
    """The uint8 array in the IDX file at path (raw or .gz), checking magic, dimensions and
    length, and reading no more than the header declares."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            header = f.read(4 + 4 * ndim)
            if len(header) < 4 + 4 * ndim:
                raise DataError(f"{path}: truncated IDX header ({len(header)} bytes)")
            if header[:3] != b"\0\0\x08" or header[3] != ndim:
                raise DataError(f"{path}: wrong magic number 0x{header[:4].hex()}, expected "
                                f"0x000008{ndim:02x} (uint8 IDX with {ndim} dimensions)")
            shape = tuple(int(d) for d in np.frombuffer(header, ">u4", count=ndim, offset=4))
            check_fits(math.prod(shape), f"the IDX header {shape}")
            if path.endswith(".gz"):
                check_inflation(math.prod(shape), os.path.getsize(path),
                                f"the IDX header {shape}")
            array = np.empty(shape, np.uint8)
            read_into(f, array, f"the data the header {shape} declares")
            return array
    except DeclaredSizeError as e:
        raise DataError(f"{path}: {e}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: corrupt or truncated gzip file ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _find_folder(name, data_dir):
    """The first candidate directory holding the first training file (raw or .gz)."""
    candidates = [data_dir] + [os.path.join(data_dir, sub) for sub in SUBDIRS[name]]
    for folder in candidates:
        stem = os.path.join(folder, SPLITS["train"][0])
        if os.path.exists(stem) or os.path.exists(stem + ".gz"):
            return folder
    files = ", ".join(f"{stem}[.gz]" for pair in SPLITS.values() for stem in pair)
    raise DataError(f"{os.path.join(data_dir, SPLITS['train'][0])}: {name} not found "
                    f"(also looked in {', '.join(candidates[1:])}); put {files} "
                    f"in --data-dir")


def _resolve(folder, stem):
    """folder/stem, preferring the uncompressed file; a missing file is a DataError."""
    for path in (os.path.join(folder, stem), os.path.join(folder, stem + ".gz")):
        if os.path.exists(path):
            return path
    raise DataError(f"{os.path.join(folder, stem)}[.gz]: missing (the other IDX files are in "
                    f"{folder}; all four must be there)")
