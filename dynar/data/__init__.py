"""Datasets and the data-parallel batch loader.

    from dynar import data
    ds = data.load("cifar10", data_dir="data")
    loader = data.Loader(ds, batch_size=256, rank=r, world=p, augment=True, seed=0)
    for epoch in range(epochs):
        for x, y in loader.batches(epoch):   # x float32 NCHW normalised, y int64
            ...

Image folders and packed shards (`python -m dynar.data pack`) are ImageDatasets: decoded by
worker threads a batch ahead (Loader(..., workers=N)), each rank only its own shard.
"""
from . import cifar, imagefolder, mnist, npz, packed, sample, synthetic
from .dataset import DataError, Dataset, ImageDataset
from .loader import Loader

NAMES = ("mnist-sample", "mnist", "fashion-mnist", "cifar10", "cifar100", "npz", "imagefolder",
         "packed", "synthetic")
# Datasets whose images are stored files decoded as they are read (ImageDataset).
IMAGE_NAMES = ("imagefolder", "packed")
DEFAULT_DATA_DIR = "data"

__all__ = ["DataError", "Dataset", "IMAGE_NAMES", "ImageDataset", "Loader", "NAMES", "load"]


def load(name, data_dir=None, seed=0, model_input_shape=None, num_classes=None):
    """The dataset `name`, checked against the model's input shape and class count if given.

    data_dir: directory of the MNIST/Fashion-MNIST/CIFAR files (default ./data), the .npz
    file (or a directory holding one) for "npz", the folder holding train/ and val/ for
    "imagefolder", the packed set's folder for "packed"; unused by mnist-sample, synthetic.
    seed: the held-out split of an npz without x_test, and the synthetic draws.
    model_input_shape (C, H, W), num_classes: shape of "synthetic" (default 3x32x32, 10
    classes); for the others, a mismatch with the model is a DataError, and for "npz"
    num_classes overrides the count inferred from the labels.
    """
    if name == "synthetic":
        ds = synthetic.load(model_input_shape or (3, 32, 32), num_classes or 10, seed=seed)
    elif name == "mnist-sample":
        ds = sample.load()
    elif name in ("mnist", "fashion-mnist"):
        ds = mnist.load(name, data_dir or DEFAULT_DATA_DIR)
    elif name == "cifar10":
        ds = cifar.load(data_dir or DEFAULT_DATA_DIR)
    elif name == "cifar100":
        ds = cifar.load_100(data_dir or DEFAULT_DATA_DIR)
    elif name == "imagefolder":
        ds = imagefolder.load(data_dir)
    elif name == "packed":
        ds = packed.load(data_dir)
    elif name == "npz":
        ds = npz.load(data_dir, seed=seed, num_classes=num_classes)
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(NAMES)}")

    if isinstance(ds, ImageDataset) and model_input_shape is not None:
        ds.resize_to(model_input_shape)
    elif model_input_shape is not None and tuple(model_input_shape) != ds.input_shape:
        raise DataError(f"{ds.name}: samples are {'x'.join(map(str, ds.input_shape))} but the "
                        f"model expects {'x'.join(map(str, model_input_shape))}")
    if num_classes is not None and ds.num_classes > num_classes:
        raise DataError(f"{ds.name}: {ds.num_classes} classes but the model has {num_classes} outputs")
    return ds
