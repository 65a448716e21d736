"""`imagefolder`: the ImageNet layout, DIR/train/<class>/... and DIR/val/<class>/...

Classes are the sub-folders of DIR/train sorted by name, label = position, as torchvision's
ImageFolder; images are the files below a class folder (recursively, in sorted order) whose
extension is one torchvision's ImageFolder reads; other files are skipped and counted. An
empty class, or train and val folders with different classes, is an error naming them.
Files are read when their batch is decoded, never all at once.
"""
import os

import numpy as np

from .dataset import IMAGENET_MEAN, IMAGENET_STD, DataError, ImageDataset
from .decode import Record

EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


class FileSplit:
    """The image files of one split: relative paths kept in one byte string (a million
    Python strings would cost each rank ~100 MB), labels in class order."""

    def __init__(self, root, files, labels):
        self.root = root
        encoded = [f.encode("utf-8", "surrogateescape") for f in files]
        self._blob = b"".join(encoded)
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        self.labels = np.asarray(labels, np.int64)

    def __len__(self):
        return len(self.labels)

    def path(self, i):
        start = int(self._ends[i - 1]) if i else 0
        rel = self._blob[start:int(self._ends[i])].decode("utf-8", "surrogateescape")
        return os.path.join(self.root, rel)

    def record(self, i):
        path = self.path(i)
        try:
            with open(path, "rb") as f:
                return Record(path, f.read())
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def scan_split(folder, classes=None):
    """(classes, FileSplit, skipped count) of one split folder; with `classes` given (the
    train split's), the folder must have exactly those."""
    try:
        found = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    except OSError as e:
        raise DataError(f"{folder}: cannot list ({e.strerror or e})") from None
    if not found:
        raise DataError(f"{folder}: no class folders (expected {folder}/<class>/<image files>)")
    if classes is not None and found != classes:
        only_here = sorted(set(found) - set(classes))
        missing = sorted(set(classes) - set(found))
        parts = ([f"not in train: {_names(only_here)}"] if only_here else []) + \
                ([f"missing: {_names(missing)}"] if missing else [])
        raise DataError(f"{folder}: classes differ from the train split's ({'; '.join(parts)})")
    files, labels, empty, skipped = [], [], [], 0
    for label, name in enumerate(found):
        mine, other = _images_below(os.path.join(folder, name), name)
        skipped += other
        if not mine:
            empty.append(name)
        files += mine
        labels += [label] * len(mine)
    if empty:
        raise DataError(f"{folder}: class folder(s) without images: {_names(empty)} "
                        f"(extensions read: {' '.join(EXTENSIONS)})")
    return found, FileSplit(folder, files, labels), skipped


def _images_below(class_dir, rel_prefix):
    """(image paths relative to the split folder, sorted as os.walk visits them; the count
    of other files)."""
    images, other = [], 0
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        dirnames.sort()
        rel = os.path.join(rel_prefix, os.path.relpath(dirpath, class_dir)) \
            if dirpath != class_dir else rel_prefix
        for name in sorted(filenames):
            if name.lower().endswith(EXTENSIONS):
                images.append(os.path.join(rel, name))
            else:
                other += 1
    return images, other


def _names(names, most=5):
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def load(data_dir):
    """The image folder at data_dir (DIR/train required, DIR/val optional)."""
    if data_dir is None:
        raise DataError("imagefolder: pass the folder holding train/ and val/ as --data-dir")
    train_dir = os.path.join(data_dir, "train")
    if not os.path.isdir(train_dir):
        raise DataError(f"{train_dir}: missing (an image folder is DIR/train/<class>/*.jpg "
                        f"and DIR/val/<class>/*.jpg)")
    classes, train, skipped = scan_split(train_dir)
    val_dir = os.path.join(data_dir, "val")
    notes = []
    test = None
    if os.path.isdir(val_dir):
        _, test, skipped_val = scan_split(val_dir, classes)
        skipped += skipped_val
    else:
        notes.append(f"no {val_dir}: nothing to evaluate on")
    if skipped:
        notes.append(f"{skipped} non-image file(s) ignored")
    return ImageDataset(name="imagefolder", train=train, test=test, classes=classes,
                        mean=IMAGENET_MEAN, std=IMAGENET_STD, kind="photo",
                        source=os.path.abspath(data_dir), notes=notes)
