"""Batches of a Dataset for one rank of a data-parallel job.

Every epoch uses one permutation of the split, drawn from (seed, epoch): identical on every
rank. Global batch k is positions [k*B, (k+1)*B) of that permutation; rank r takes the
contiguous shard [r*B/world, (r+1)*B/world) of it. So the union of the shards of all ranks
is the global batch, and `-n 1`, `-n 2`, `-n 4` see the same samples in the same steps.
With M micro-batches (gradient accumulation) the global batch is M consecutive slices of
B/M and rank r's shard is its share of each, one after the other: micro-batch m holds the
same samples on any rank count, which BatchNorm (normalizing each micro-batch over all
ranks) needs.

Arrays in memory (Dataset) are gathered and augmented a batch at a time; stored images
(ImageDataset) are decoded by pipeline.ImageBatches, each rank decoding only its shard.
"""
import numpy as np

from . import transforms
from .augment import crop_flip, draw, padded_buffer
from .dataset import ImageDataset
from .pipeline import DEFAULT_PREFETCH, ImageBatches

_STREAM = 0  # permutation draws; augment uses stream 1


class Loader:
    """Iterates one split of a dataset as this rank's (x, y) shards, epoch by epoch.

    batch_size is the GLOBAL batch: it must be divisible by world, and each rank yields
    batch_size // world samples per step. With drop_last (default for "train") the final
    incomplete global batch is dropped, so every rank does exactly `steps` full steps. Without
    it (default for "test", where every sample should count) the last global batch is smaller
    and split as evenly as possible: a rank's last shard may be short, even empty, but every
    rank still yields `steps` batches.

    Yields x: float32 C-contiguous (n, C, H, W), normalised with the dataset's mean/std, and
    y: int64 (n,). Both are views of buffers reused by the next step: copy them to keep them.

    An ImageDataset's images are decoded by `workers` threads (0: on the caller's thread),
    `prefetch` batches ahead; skip_bad replaces unreadable images (pipeline.py).
    """

    def __init__(self, dataset, batch_size, rank=0, world=1, split="train", shuffle=None,
                 drop_last=None, augment=False, seed=0, workers=1, prefetch=DEFAULT_PREFETCH,
                 skip_bad=False, micro_batches=1):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in range for world size {world}")
        if batch_size < 1 or batch_size % world:
            raise ValueError(f"batch_size {batch_size} (the global batch) must be a positive "
                             f"multiple of the world size {world}")
        if micro_batches < 1 or batch_size % (world * micro_batches):
            raise ValueError(f"batch_size {batch_size} (the global batch) does not split into "
                             f"{world} rank(s) x {micro_batches} equal micro-batches")
        if micro_batches > 1 and split != "train":
            raise ValueError("micro_batches: only the training split is cut into micro-batches")
        self.micro_batches = micro_batches
        if augment and not dataset.augmentable:
            raise ValueError(f"augment: random crop and flip are not defined for {dataset.name}")
        self.y = dataset.y_train if split == "train" else dataset.y_test
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.shuffle = split == "train" if shuffle is None else shuffle
        self.drop_last = split == "train" if drop_last is None else drop_last
        self.augment, self.seed = augment, seed
        n = len(self.y)
        self.steps = n // batch_size if self.drop_last else -(-n // batch_size)
        if self.steps == 0:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} samples of the "
                             f"{dataset.name} {split} split")

        per_rank = batch_size // world
        channels = dataset.input_shape[0]
        # (x * scale - mean) / std folded into one multiply-add per element.
        std = np.asarray(dataset.std, np.float32)
        self._gain = (np.float32(dataset.scale) / std).reshape(channels, 1, 1)
        self._bias = (-np.asarray(dataset.mean, np.float32) / std).reshape(channels, 1, 1)
        self.images = None
        if isinstance(dataset, ImageDataset):
            self.transform = transforms.for_split(dataset.kind, split == "train", augment,
                                                  dataset.input_shape[1])
            self.images = ImageBatches(dataset.train if split == "train" else dataset.test,
                                       self.transform, dataset.input_shape, per_rank,
                                       self._gain, self._bias, workers, prefetch, skip_bad)
            return
        self.x = dataset.x_train if split == "train" else dataset.x_test
        self._raw = np.empty((per_rank,) + self.x.shape[1:], self.x.dtype)
        self._x = np.empty((per_rank,) + self.x.shape[1:], np.float32)
        self._y = np.empty(per_rank, np.int64)
        self._padded = padded_buffer(per_rank, *self.x.shape[1:], self.x.dtype) \
            if self.augment else None

    def order(self, epoch):
        """Sample indices of the split in the order the epoch visits them (same on every rank)."""
        if not self.shuffle:
            return np.arange(len(self.y))
        return np.random.default_rng([self.seed, _STREAM, epoch]).permutation(len(self.y))

    def shard(self, step):
        """[(lo, hi), ...] positions, within the epoch order, of this rank's part of global
        batch step: one range, or one per micro-batch."""
        start = step * self.batch_size
        size = min(self.batch_size, len(self.y) - start)
        piece = size // self.micro_batches     # micro_batches > 1: full batches only
        return [(start + m * piece + self.rank * piece // self.world,
                 start + m * piece + (self.rank + 1) * piece // self.world)
                for m in range(self.micro_batches)]

    def batches(self, epoch, start=0):
        """This rank's (x, y) for each of the steps [start, steps) of epoch (a resumed run
        starts mid-epoch without reading the batches before)."""
        order = self.order(epoch)
        if self.images is not None:
            yield from self.images.run(self._image_jobs(order, epoch, start))
            return
        for step in range(start, self.steps):
            positions = self.positions(step)
            idx = order[positions]
            n = len(idx)
            raw, x, y = self._raw[:n], self._x[:n], self._y[:n]
            # mode="clip" skips numpy's bounds-check buffering; idx is a permutation, in range.
            np.take(self.x, idx, axis=0, out=raw, mode="clip")
            np.take(self.y, idx, out=y, mode="clip")
            if self.augment:
                dy, dx, flip = draw(self.seed, epoch, step, self.batch_size)
                first = positions - step * self.batch_size   # places in the global batch
                crop_flip(raw, self._padded, dy[first], dx[first], flip[first])
            np.multiply(raw, self._gain, out=x)
            x += self._bias
            yield x, y

    def positions(self, step):
        """This rank's positions, within the epoch order, of global batch step's samples."""
        return np.concatenate([np.arange(lo, hi) for lo, hi in self.shard(step)])

    def _image_jobs(self, order, epoch, start):
        for step in range(start, self.steps):
            positions = self.positions(step)
            yield (order[positions], self.transform.draws(self.seed, epoch, step,
                                                          self.batch_size),
                   positions - step * self.batch_size)

    def describe(self):
        """What feeds the batches, for the start line."""
        if self.images is None:
            return "arrays in memory" + (", random crop + flip" if self.augment else "")
        workers = self.images.workers
        return (f"{self.transform.name}, {workers} decode thread(s) per rank, "
                f"{self.images.prefetch} batch(es) prefetched" if workers else
                f"{self.transform.name}, decoded on the training thread (no prefetch)")

    def close(self):
        if self.images is not None:
            self.images.close()

    def __len__(self):
        return self.steps
