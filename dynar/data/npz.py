"""A dataset from a user's .npz file: `x`, `y`, and optionally `x_test`, `y_test`.

`x` is uint8 or float, NCHW or NHWC (the layout is the one whose channel axis has 1 or 3
entries), or (N, H, W) for single-channel images. Without `x_test`/`y_test` a seeded tenth
of the samples is held out. CIFAR's crop + flip may be asked for (--augment): whether a
flipped sample is still of its class only the user knows. The archive is read within the
sizes its members declare (dynar/bounded_read.py), and the labels decide the class count
only when they can: not past one class per sample.
"""
import glob
import os

import numpy as np

from ..bounded_read import read_npz
from .dataset import DataError, Dataset

HELD_OUT = 0.1


def load(data_dir, seed=0, num_classes=None):
    """Dataset from data_dir (a .npz file, or a directory holding exactly one)."""
    path = _find_file(data_dir)
    try:
        with open(path, "rb") as f:
            if f.read(6) == b"\x93NUMPY":
                raise DataError(f"{path}: a single .npy array, expected an .npz archive with "
                                f"x and y")
        arrays = read_npz(path, ("x", "y", "x_test", "y_test"))
    except DataError:
        raise
    except Exception as e:
        # A damaged archive makes zipfile or numpy's .npy header parser raise nearly anything
        # (BadZipFile, NotImplementedError, tokenize.TokenError, ...): all mean "unreadable".
        raise DataError(f"{path}: not a readable .npz file ({e})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{path}: no array named {key!r} (found {sorted(arrays) or 'none'})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: x_test and y_test must be given together")

    x, y = _images(path, "x", arrays["x"]), _labels(path, "y", arrays["y"], len(arrays["x"]))
    if "x_test" in arrays:
        x_test = _images(path, "x_test", arrays["x_test"])
        y_test = _labels(path, "y_test", arrays["y_test"], len(arrays["x_test"]))
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: x_test samples are {x_test.shape[1:]} but x samples are {x.shape[1:]}")
        if (x.dtype.kind == "f") != (x_test.dtype.kind == "f"):
            # Integer pixels are 0..255, floats usually 0..1: converting one to the other
            # would silently change the test images' scale.
            raise DataError(f"{path}: x is {x.dtype} but x_test is {x_test.dtype}; give both "
                            f"as integer pixels or both as floats")
        x_test = x_test.astype(x.dtype, copy=False)
    else:
        if len(x) < 2:
            raise DataError(f"{path}: {len(x)} sample(s), too few to hold out a test split")
        order = np.random.default_rng(seed).permutation(len(x))
        n_test = max(1, int(round(HELD_OUT * len(x))))
        x_test, y_test = x[order[:n_test]], y[order[:n_test]]
        x, y = x[order[n_test:]], y[order[n_test:]]

    seen = int(max(y.max(initial=0), y_test.max(initial=0))) + 1
    if num_classes is None:
        if seen > len(y) + len(y_test):
            # A model with an output per class would be built from this: 10^9 of them.
            raise DataError(f"{path}: the largest label, {seen - 1}, would make {seen} classes "
                            f"for {len(y) + len(y_test)} samples; pass --num-classes if the "
                            f"model should really have that many outputs")
        num_classes = seen
    elif seen > num_classes:
        raise DataError(f"{path}: label {seen - 1} does not fit num_classes={num_classes}")
    mean, std = _channel_stats(x)
    return Dataset(name=f"npz:{os.path.basename(path)}", x_train=np.ascontiguousarray(x),
                   y_train=y, x_test=np.ascontiguousarray(x_test), y_test=y_test,
                   num_classes=num_classes, mean=mean, std=std, augmentable=True)


def _images(path, key, x):
    if x.dtype != np.uint8 and x.dtype.kind not in "fiu":
        raise DataError(f"{path}: {key} has dtype {x.dtype}, expected uint8, integer or float")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        nchw, nhwc = x.shape[1] in (1, 3), x.shape[3] in (1, 3)
        if nchw == nhwc:
            raise DataError(f"{path}: cannot tell whether {key} of shape {x.shape} is NCHW or NHWC "
                            f"(exactly one of axes 1 and 3 must have 1 or 3 channels)")
        if nhwc:
            x = x.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"{path}: {key} has shape {x.shape}, expected (N, C, H, W), (N, H, W, C) "
                        f"or (N, H, W)")
    if len(x) == 0:
        raise DataError(f"{path}: {key} is empty")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{path}: {key} contains NaN or infinity")
    return x


def _labels(path, key, y, n):
    if y.dtype.kind not in "iu" or y.shape != (n,):
        raise DataError(f"{path}: {key} is {y.dtype} {y.shape}, expected integers of shape ({n},)")
    if y.size and y.min() < 0:
        raise DataError(f"{path}: {key} has negative label {y.min()}")
    return y.astype(np.int64)


def _channel_stats(x):
    """Per-channel mean/std of the training images, in [0, 1] units for uint8."""
    scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
    mean, std = [], []
    for c in range(x.shape[1]):
        # One channel at a time in float64: exact enough, and never a full float64 copy.
        v = x[:, c].astype(np.float64) * scale
        m = v.mean()
        s = v.std()
        mean.append(m)
        std.append(s if s > 0 else 1.0)  # a constant channel: centre it, do not divide by 0
    return mean, std


def _find_file(data_dir):
    if data_dir is None:
        raise DataError("npz: pass the .npz file (or a directory holding one) as --data-dir")
    if os.path.isdir(data_dir):
        found = sorted(glob.glob(os.path.join(data_dir, "*.npz")))
        if len(found) != 1:
            raise DataError(f"{data_dir}: expected exactly one .npz file, found "
                            f"{len(found) or 'none'}{': ' + ', '.join(map(os.path.basename, found)) if found else ''}")
        return found[0]
    if not os.path.exists(data_dir):
        raise DataError(f"{data_dir}: no such .npz file")
    return data_dir
