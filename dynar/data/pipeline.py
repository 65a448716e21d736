"""Decoding a rank's share of each global batch beside the compute: a bounded prefetch.

Worker threads decode and transform image by image straight into the uint8 batch buffer of
a slot, then normalise that image into the slot's float32 buffer (one vectorised
multiply-add; numpy, simplejpeg and Pillow all release the GIL, so the threads run in
parallel with each other and with the compute kernels). `prefetch` batches are in flight
while the caller trains on the current one; slots = prefetch + 1, and a slot is refilled
only after the caller has asked for the next batch, so a yielded batch stays valid until
then. With workers=0 images are decoded on the caller's thread when asked (no overlap).

A corrupt image is a DataError naming its file; with skip_bad it is replaced by the next
readable image of the same class (the same one on every run and at every rank count, with
the same random crop), and counted once, when first met.
"""
import collections
import concurrent.futures
import threading

import numpy as np

from .dataset import DataError
from .decode import Opened

DEFAULT_PREFETCH = 2


def default_workers(cores_per_rank, compute_threads):
    """Decode threads per rank when --data-workers is not given: one per core this rank's
    compute threads leave free, and at least one, so decoding overlaps compute. Measured on
    2 cores (docs/data.md): a second decode thread per rank beside compute gained nothing and
    slowed the compute threads it preempted."""
    return max(1, cores_per_rank - compute_threads)


class ImageBatches:
    """Fills (x float32, y int64) batches of `split` for one rank, `per_rank` images a step."""

    def __init__(self, split, transform, input_shape, per_rank, gain, bias, workers=1,
                 prefetch=DEFAULT_PREFETCH, skip_bad=False):
        self.split, self.transform = split, transform
        self.gain, self.bias = gain, bias
        self.workers, self.skip_bad = workers, skip_bad
        self.prefetch = prefetch if workers else 0
        shape = (per_rank,) + tuple(input_shape)
        self._slots = [(np.empty(shape, np.uint8), np.empty(shape, np.float32),
                        np.empty(per_rank, np.int64)) for _ in range(self.prefetch + 1)]
        self._pool = None
        self._lock = threading.Lock()
        self._members = {}              # label -> sorted indices of that class (skip_bad)
        self.bad_files = set()          # unreadable images met since take_bad_files()
        self._known_bad = set()         # their indices: replaced without decoding again

    def run(self, steps):
        """Yield (x, y) for each (indices, draws, each image's row in the global batch) of
        `steps`."""
        steps = iter(steps)
        if not self.workers:
            for n, job in enumerate(steps):
                slot = self._slots[0]
                for k, (index, row) in enumerate(self._samples(job)):
                    self._fill(slot, k, index, job[1], row)
                yield self._view(slot, job)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers,
                                                               thread_name_prefix="dynar-data")
        pending = collections.deque()
        count = 0

        def submit():
            nonlocal count
            job = next(steps, None)
            if job is None:
                return
            slot = self._slots[count % len(self._slots)]
            count += 1
            futures = [self._pool.submit(self._fill, slot, k, index, job[1], row)
                       for k, (index, row) in enumerate(self._samples(job))]
            pending.append((slot, job, futures))

        try:
            for _ in range(self.prefetch):
                submit()
            while pending:
                slot, job, futures = pending.popleft()
                for future in futures:
                    future.result()           # the first failure, as raised in the worker
                yield self._view(slot, job)
                submit()
        finally:
            # Left early (an error, a break): nothing may still write into the slots.
            everything = [f for _, _, futures in pending for f in futures]
            for f in everything:
                f.cancel()
            concurrent.futures.wait(everything)

    def _samples(self, job):
        indices, _, rows = job
        return ((int(i), int(row)) for i, row in zip(indices, rows))

    def _view(self, slot, job):
        n = len(job[0])
        x, y = slot[1][:n], slot[2][:n]
        np.take(self.split.labels, job[0], out=y)
        return x, y

    def _fill(self, slot, k, index, draws, row):
        images = slot[0]
        attempt, i = 0, index
        while True:
            try:
                if i in self._known_bad:
                    raise DataError("known bad")
                self.transform.render(Opened(self.split.record(i)), draws, row, images[k])
                break
            except DataError as e:
                if not self.skip_bad:
                    raise
                with self._lock:
                    if i not in self._known_bad:
                        self._known_bad.add(i)
                        self.bad_files.add(str(e).split(": ", 1)[0])
                attempt += 1
                i = self._substitute(index, attempt)
        np.multiply(images[k], self.gain, out=slot[1][k])
        slot[1][k] += self.bias

    def _substitute(self, index, attempt):
        """The attempt-th image after `index` among those of its class, cyclically."""
        label = int(self.split.labels[index])
        with self._lock:
            members = self._members.get(label)
            if members is None:
                members = self._members[label] = np.flatnonzero(self.split.labels == label)
        if attempt >= len(members):
            raise DataError(f"class {label}: none of its {len(members)} images is readable")
        return int(members[(np.searchsorted(members, index) + attempt) % len(members)])

    def take_bad_files(self):
        """The unreadable images first met since the last call (--skip-bad-images)."""
        with self._lock:
            names, self.bad_files = sorted(self.bad_files), set()
        return names

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
