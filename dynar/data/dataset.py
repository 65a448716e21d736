"""What the readers produce: Dataset (arrays in memory: MNIST, CIFAR, npz, synthetic) and
ImageDataset (images decoded as they are needed: image folders, packed shards), and the
error every reader raises."""
from dataclasses import dataclass, field

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


# torchvision's ImageNet statistics, in [0, 1] units: what photographs are normalised with.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageDataset:
    """Train and test splits of stored images, decoded and transformed batch by batch.

    A split has `labels` (int64, one per image), `len()` and `record(i)`, the i-th stored
    image as a decode.Record. kind "photo": photographs of any size, cropped and resized to
    input_shape by the ImageNet recipe (dynar/data/transforms.py), whose side follows the
    model (resize_to); kind "array": fixed-size images (packed MNIST/CIFAR/npz), augmented as
    CIFAR is. classes: the class names, index = label (sorted folder names for a folder).
    """

    name: str
    train: object
    test: object
    classes: list
    mean: tuple
    std: tuple
    kind: str = "photo"
    input_shape: tuple = (3, 224, 224)
    source: str = ""             # what the start line says the images come from
    notes: list = field(default_factory=list)
    augment_by_default: bool = True   # photographs and CIFAR, not digits
    synthetic = False
    augmentable = True
    scale = 1.0 / 255.0

    @property
    def num_classes(self):
        return len(self.classes)

    @property
    def y_train(self):
        return self.train.labels

    @property
    def y_test(self):
        return self.test.labels if self.test is not None else np.zeros(0, np.int64)

    def resize_to(self, shape):
        """Produce (C, H, W) = shape inputs: any square 3-channel size for photographs;
        fixed-size images only at their own size."""
        shape = tuple(int(d) for d in shape)
        if self.kind == "photo" and shape[0] == 3 and shape[1] == shape[2]:
            self.input_shape = shape
        elif shape != tuple(self.input_shape):
            have = "x".join(map(str, self.input_shape)) if self.kind != "photo" else \
                "3-channel photographs (square crops of any size)"
            raise DataError(f"{self.name}: the model takes {'x'.join(map(str, shape))} inputs but "
                            f"the images are {have}")

    def __repr__(self):
        c, h, w = self.input_shape
        return (f"ImageDataset({self.name}: {len(self.y_train)} train / {len(self.y_test)} "
                f"test, {self.kind}, {c}x{h}x{w}, {self.num_classes} classes)")
