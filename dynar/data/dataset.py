"""The in-memory dataset every reader produces, and the error every reader raises."""
from dataclasses import dataclass

import numpy as np


class DataError(ValueError):
    """A dataset file is missing, truncated, corrupt or inconsistent.

    The message is one line naming the path and what is wrong with it, so it can be shown
    as-is by the train CLI (on every rank).
    """


@dataclass
class Dataset:
    """Train and test arrays plus what is needed to normalise them.

    x_* are NCHW, either uint8 pixels (kept as uint8: 4x less memory, and the loader converts
    one batch at a time) or float32 values. mean/std are per channel, in units of
    ``x * scale`` (pixels scaled to [0, 1] for uint8), so a normalised input is
    ``(x * scale - mean) / std``.
    """

    name: str
    x_train: np.ndarray  # (N, C, H, W) uint8 or float32
    y_train: np.ndarray  # (N,) int64
    x_test: np.ndarray  # (M, C, H, W), same dtype as x_train
    y_test: np.ndarray  # (M,) int64
    num_classes: int
    mean: tuple
    std: tuple
    synthetic: bool = False
    # Random crop + horizontal flip only make sense for natural images (a flipped digit is
    # another symbol), so the loader refuses augmentation unless the dataset allows it.
    augmentable: bool = False

    def __post_init__(self):
        for split in ("train", "test"):
            x, y = getattr(self, "x_" + split), getattr(self, "y_" + split)
            if x.ndim != 4 or x.dtype not in (np.uint8, np.float32) or not x.flags.c_contiguous:
                raise ValueError(f"{self.name}: x_{split} must be C-contiguous (N, C, H, W) uint8 or "
                                 f"float32, got {x.dtype} {x.shape}")
            if y.shape != (x.shape[0],) or y.dtype != np.int64:
                raise ValueError(f"{self.name}: y_{split} must be int64 of shape ({x.shape[0]},), "
                                 f"got {y.dtype} {y.shape}")
        if self.x_test.shape[1:] != self.x_train.shape[1:] or self.x_test.dtype != self.x_train.dtype:
            raise ValueError(f"{self.name}: train and test images differ in shape or dtype")
        channels = self.x_train.shape[1]
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"{self.name}: need one mean and one std per channel ({channels})")

    @property
    def input_shape(self):
        """(C, H, W) of one sample."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def scale(self):
        """Factor that maps stored values to the units of mean/std."""
        return 1.0 / 255.0 if self.x_train.dtype == np.uint8 else 1.0

    def __repr__(self):
        c, h, w = self.input_shape
        kind = " (synthetic)" if self.synthetic else ""
        return (f"Dataset({self.name}{kind}: {len(self.y_train)} train / {len(self.y_test)} test, "
                f"{c}x{h}x{w} {self.x_train.dtype}, {self.num_classes} classes)")
