"""CIFAR-10 from the binary (cifar-10-batches-bin) or Python (cifar-10-batches-py) release,
and CIFAR-100 from its Python release (cifar-100-python: train, test, meta)."""
import os
import pickle

import numpy as np

from .dataset import DataError, Dataset

TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
TEST = "test_batch"
PIXELS = 3 * 32 * 32
RECORD = 1 + PIXELS  # binary release: one label byte, then the 3x32x32 image, channel-major

# Per-channel mean/std of the 50,000 training images (the true std; the often-copied
# (0.2023, 0.1994, 0.2010) is a std of per-image means, not of pixels).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

# CIFAR-100's training set, per channel (the pixel std, as above).
MEAN_100 = (0.5071, 0.4865, 0.4409)
STD_100 = (0.2673, 0.2564, 0.2762)

# The Python release pickles a dict holding a numpy array; only what that needs may be
# resolved, so a hostile file cannot name an arbitrary callable. (_codecs.encode is how a
# protocol-2 pickle written by Python 3 spells a bytes object.)
_PICKLE_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


def load(data_dir):
    """CIFAR-10 from data_dir, its cifar-10-batches-bin/ or its cifar-10-batches-py/."""
    folder, binary = _find_folder(data_dir)
    read = _read_binary if binary else _read_pickle
    suffix = ".bin" if binary else ""
    parts = [read(_require(os.path.join(folder, stem + suffix))) for stem in TRAIN]
    x_test, y_test = read(_require(os.path.join(folder, TEST + suffix)))
    return Dataset(name="cifar10",
                   x_train=np.concatenate([x for x, _ in parts]),
                   y_train=np.concatenate([y for _, y in parts]),
                   x_test=x_test, y_test=y_test, num_classes=10, mean=MEAN, std=STD,
                   augmentable=True)


def _read_binary(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) == 0 or len(data) % RECORD:
        raise DataError(f"{path}: {len(data)} bytes is not a whole number of {RECORD}-byte "
                        f"CIFAR-10 records (truncated or not a CIFAR-10 binary batch)")
    records = np.frombuffer(data, np.uint8).reshape(-1, RECORD)
    labels = records[:, 0].astype(np.int64)
    _check_labels(path, labels)
    return np.ascontiguousarray(records[:, 1:]).reshape(-1, 3, 32, 32), labels


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def load_100(data_dir):
    """CIFAR-100 (fine labels, 100 classes) from data_dir or its cifar-100-python/."""
    for folder in (data_dir, os.path.join(data_dir, "cifar-100-python")):
        if os.path.exists(os.path.join(folder, "train")) and os.path.exists(os.path.join(folder, "test")):
            break
    else:
        raise DataError(f"{data_dir}: CIFAR-100 not found; put the extracted cifar-100-python/ "
                        f"(train, test, meta) in --data-dir")
    x_train, y_train = _read_pickle(os.path.join(folder, "train"), b"fine_labels", 100)
    x_test, y_test = _read_pickle(os.path.join(folder, "test"), b"fine_labels", 100)
    return Dataset(name="cifar100", x_train=x_train, y_train=y_train, x_test=x_test,
                   y_test=y_test, num_classes=100, mean=MEAN_100, std=STD_100,
                   augmentable=True)


def _read_pickle(path, label_key=b"labels", classes=10):
    what = "CIFAR-10" if classes == 10 else "CIFAR-100"
    try:
        with open(path, "rb") as f:
            # The batches were pickled by Python 2: keys are bytes, arrays need latin1.
            batch = _CifarUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as e:
        raise DataError(f"{path}: not a readable {what} Python batch ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise DataError(f"{path}: expected a dict with b'data' and {label_key!r}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        raise DataError(f"{path}: b'data' is {data.dtype} {data.shape}, expected uint8 (N, {PIXELS})")
    if labels.shape != (data.shape[0],) or labels.dtype.kind not in "iu":
        raise DataError(f"{path}: {labels.shape} labels for {data.shape[0]} images")
    labels = labels.astype(np.int64)
    _check_labels(path, labels, classes)
    return np.ascontiguousarray(data).reshape(-1, 3, 32, 32), labels


def _check_labels(path, labels, classes=10):
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        bad = labels.max() if labels.max() >= classes else labels.min()
        raise DataError(f"{path}: label {bad} out of range 0-{classes - 1}")


def _find_folder(data_dir):
    """(folder, is_binary) for the first layout found; the binary release wins if both are."""
    for folder in (data_dir, os.path.join(data_dir, "cifar-10-batches-bin"),
                   os.path.join(data_dir, "cifar-10-batches-py")):
        if os.path.exists(os.path.join(folder, TRAIN[0] + ".bin")):
            return folder, True
        if os.path.exists(os.path.join(folder, TRAIN[0])):
            return folder, False
    raise DataError(f"{data_dir}: CIFAR-10 not found; put cifar-10-batches-bin/ "
                    f"(data_batch_1.bin..data_batch_5.bin, test_batch.bin) or cifar-10-batches-py/ "
                    f"(data_batch_1..data_batch_5, test_batch) in --data-dir")


def _require(path):
    if not os.path.exists(path):
        raise DataError(f"{path}: missing (CIFAR-10 needs data_batch_1..5 and test_batch "
                        f"side by side)")
    return path
