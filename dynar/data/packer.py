"""`python -m dynar.data pack SRC DEST`: an image folder (or an array dataset) to packed
shards (packed.py reads them; docs/data.md describes the format).

Photographs are resized so that the shorter side is `size` (never enlarged; None keeps
them) and stored as JPEG: a JPEG that needs no resizing is copied byte for byte, so it
decodes exactly as the folder's file does; a resized image is encoded at `quality`; any
other image that needs no resizing (PNG, BMP, a CMYK JPEG, ...) is stored as its decoded
RGB pixels, never re-encoded lossily. encoding "raw" stores every image as raw pixels. Array datasets (MNIST, CIFAR, npz) are stored raw
at their own size.

Each shard is written to a temporary file and renamed, then a small index of its records
is saved in DEST/.pack/: an interrupted run, rerun with the same arguments, keeps the
shards it finished and goes on from there. DEST/meta.json is written last: a packed set
without it is unfinished and refused by the reader.
"""
import concurrent.futures
import glob
import hashlib
import io
import json
import os
import shutil
import sys
import time
import zlib

import numpy as np
import simplejpeg
from PIL import Image

from ..atomic_write import write_binary, write_text
from . import imagefolder, packed, transforms
from .dataset import DataError, Dataset
from .decode import Opened

DEFAULT_SIZE = 256
DEFAULT_QUALITY = 90
DEFAULT_SHARD_MB = 256
WORK = ".pack"
_CHUNK = 64          # records encoded per round of the worker pool


def pack(source, dest, dataset="imagefolder", size=DEFAULT_SIZE, quality=DEFAULT_QUALITY,
         encoding="jpeg", shard_mb=DEFAULT_SHARD_MB, workers=None, skip_bad=False,
         stream=None):
    """Pack `source` (an image folder, or the data dir of `dataset`) into `dest`; returns
    the number of images skipped as unreadable (skip_bad; otherwise a DataError)."""
    stream = stream or sys.stderr
    if encoding not in packed.ENCODINGS:
        raise DataError(f"--encoding: {encoding!r} is not one of {', '.join(packed.ENCODINGS)}")
    if not 1 <= quality <= 100:
        raise DataError(f"--quality: {quality} is not in 1-100")
    source_ds = _open_source(source, dataset)
    photo = not isinstance(source_ds, Dataset)
    splits = {"train": _split_of(source_ds, "train"), "val": _split_of(source_ds, "test")}
    splits = {k: v for k, v in splits.items() if v is not None and len(v[1])}
    settings = {"format": packed.FORMAT, "source": os.path.abspath(source), "dataset": dataset,
                "size": size if photo else None, "quality": quality, "encoding": encoding,
                "shard_bytes": int(shard_mb * (1 << 20)),
                "listing_sha256": _listing_digest(splits)}
    if os.path.exists(os.path.join(dest, packed.META)):
        raise DataError(f"{dest}: already holds a packed set ({packed.META}); remove it or "
                        f"choose another DEST")
    work = os.path.join(dest, WORK)
    os.makedirs(work, exist_ok=True)
    plan_path = os.path.join(work, "plan.json")
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            before = json.load(f)
        if before != settings:
            changed = sorted(k for k in settings if before.get(k) != settings[k])
            raise DataError(f"{dest}: holds an interrupted packing with other settings "
                            f"({', '.join(changed)}); rerun it with the same arguments, or "
                            f"remove {dest}")
    else:
        write_text(plan_path, json.dumps(settings, indent=1))
    for stale in glob.glob(os.path.join(glob.escape(dest), ".*.tmp")):
        os.unlink(stale)       # a killed run's half-written shard

    workers = workers or len(os.sched_getaffinity(0))
    encode = _photo_encoder(size, quality, encoding) if photo else _array_encoder
    skipped = 0
    infos = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for split, (_, records) in splits.items():
            writer = _SplitWriter(dest, work, split, settings["shard_bytes"])
            progress = _Progress(f"packing {split}", len(records), writer.done, stream)
            for start in range(writer.done, len(records), _CHUNK):
                chunk = range(start, min(start + _CHUNK, len(records)))
                for i, encoded in zip(chunk, pool.map(
                        lambda i: _encode_or_skip(records, i, encode, skip_bad), chunk)):
                    if encoded is None:
                        skipped += 1
                    else:
                        writer.add(i, *encoded, int(records.labels[i]))
                progress.update(chunk.stop)
            writer.close(len(records))
            progress.finish()
            infos[split] = writer.finish()

    classes = list(source_ds.classes) if photo else [str(c) for c in range(source_ds.num_classes)]
    meta = {"format": packed.FORMAT, "name": dataset if not photo else
            os.path.basename(os.path.abspath(source).rstrip(os.sep)),
            "kind": "photo" if photo else "array", "classes": classes,
            "mean": list(source_ds.mean), "std": list(source_ds.std),
            "shape": None if photo else list(source_ds.input_shape),
            "packed": {k: settings[k] for k in ("source", "dataset", "size", "quality",
                                                 "encoding", "shard_bytes")},
            "augment_by_default": photo or dataset in ("cifar10", "cifar100"),
            "skipped_images": skipped, "splits": infos}
    write_text(os.path.join(dest, packed.META), json.dumps(meta, indent=1))
    shutil.rmtree(work)
    return skipped


def _open_source(source, dataset):
    if dataset == "imagefolder":
        return imagefolder.load(source)
    from . import load
    ds = load(dataset, data_dir=source)
    if ds.x_train.dtype != np.uint8:
        raise DataError(f"{source}: {ds.x_train.dtype} images; packed sets hold uint8 pixels")
    return ds


class _ArrayRecords:
    """An array split seen as records (raw HWC bytes)."""

    def __init__(self, x, labels):
        self.x, self.labels = x, labels

    def __len__(self):
        return len(self.labels)


def _split_of(ds, split):
    """(name, records) of a split, or None."""
    if isinstance(ds, Dataset):
        x, y = (ds.x_train, ds.y_train) if split == "train" else (ds.x_test, ds.y_test)
        return split, _ArrayRecords(x, y)
    files = ds.train if split == "train" else ds.test
    return (split, files) if files is not None else None


def _listing_digest(splits):
    """What is being packed: the files' names and labels, or the arrays' bytes."""
    digest = hashlib.sha256()
    for split, (_, records) in sorted(splits.items()):
        digest.update(split.encode())
        if isinstance(records, _ArrayRecords):
            digest.update(np.ascontiguousarray(records.x).data)
        else:
            digest.update(records._blob)
            digest.update(records._ends.tobytes())
        digest.update(records.labels.tobytes())
    return digest.hexdigest()


def _encode_or_skip(records, i, encode, skip_bad):
    try:
        return encode(records, i)
    except DataError:
        if skip_bad:
            return None
        raise


def _array_encoder(records, i):
    image = np.ascontiguousarray(records.x[i].transpose(1, 2, 0))
    return image.tobytes(), 0, image.shape


def _photo_encoder(size, quality, encoding):
    def encode(records, i):
        record = records.record(i)
        opened = Opened(record)
        h, w = opened.height, opened.width
        resize = size is not None and min(h, w) > size
        if not resize and encoding == "jpeg" and opened.kind == "jpeg":
            return bytes(record.data), 1, (h, w, 3)
        if resize:
            oh, ow = transforms.resize_shorter(h, w, size)
            pixels = transforms.decode_for(opened, h, w, oh, ow)
            s = transforms.dct_scale(pixels, w)
            pixels = np.asarray(Image.fromarray(pixels).resize(
                (ow, oh), Image.BILINEAR, box=(0, 0, w * s, h * s)))
        else:
            pixels = opened.pixels()
        if encoding == "jpeg" and resize:
            blob = simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality,
                                          colorspace="RGB", colorsubsampling="420")
            return blob, 1, pixels.shape
        return np.ascontiguousarray(pixels).tobytes(), 0, pixels.shape
    return encode


class _SplitWriter:
    """Appends records to shards of about shard_bytes; each finished shard is renamed into
    place, then its part of the index saved in the work folder (resumable from there)."""

    def __init__(self, dest, work, split, shard_bytes):
        self.dest, self.work, self.split, self.shard_bytes = dest, work, split, shard_bytes
        self.parts = sorted(glob.glob(os.path.join(glob.escape(work), f"{split}-*.index.npy")))
        self.done = 0           # source records handled by the finished shards
        self.shards = []
        for number, part in enumerate(self.parts):
            rows = np.load(part, allow_pickle=False)
            meta_path = part[:-len(".index.npy")] + ".json"
            with open(meta_path) as f:
                done = json.load(f)["source_records_done"]
            shard = os.path.join(dest, packed.shard_name(split, number))
            size = int(rows["length"].sum()) if len(rows) else 0
            if not os.path.exists(shard) or os.path.getsize(shard) != size:
                raise DataError(f"{shard}: does not match {part} (remove {dest} and pack again)")
            self.shards.append({"file": os.path.basename(shard), "bytes": size})
            self.done = done
        self._buffer = io.BytesIO()
        self._rows = []

    def add(self, i, blob, encoding, shape, label):
        if self._rows and self._buffer.tell() + len(blob) > self.shard_bytes:
            self._flush(i)
        h, w, c = shape
        self._rows.append((len(self.shards), self._buffer.tell(), len(blob), h, w, c,
                           encoding, label, zlib.crc32(blob)))
        self._buffer.write(blob)

    def _flush(self, next_source):
        number = len(self.shards)
        path = os.path.join(self.dest, packed.shard_name(self.split, number))
        data = self._buffer.getvalue()
        write_binary(path, lambda f: f.write(data))
        rows = np.array(self._rows, packed.INDEX_DTYPE)
        stem = os.path.join(self.work, f"{self.split}-{number:05d}")
        write_binary(stem + ".index.npy", lambda f: np.save(f, rows, allow_pickle=False))
        write_text(stem + ".json", json.dumps({"source_records_done": next_source}))
        self.parts.append(stem + ".index.npy")
        self.shards.append({"file": os.path.basename(path), "bytes": len(data)})
        self._buffer = io.BytesIO()
        self._rows = []

    def close(self, total):
        if self._rows:
            self._flush(total)

    def finish(self):
        """Write the split's index; its description for meta.json."""
        parts = [np.load(p, allow_pickle=False) for p in self.parts]
        index = np.concatenate(parts) if parts else np.zeros(0, packed.INDEX_DTYPE)
        path = os.path.join(self.dest, packed.index_name(self.split))
        write_binary(path, lambda f: np.save(f, index, allow_pickle=False))
        return {"records": len(index), "index": os.path.basename(path),
                "index_sha256": packed.file_sha256(path), "shards": self.shards}


def _fmt_duration(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Progress:
    """A progress line on stderr: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, what, total, done, stream):
        self.what, self.total, self.start_done, self.stream = what, total, done, stream
        self.live = stream.isatty()
        self.t0 = time.monotonic()
        self._shown = -1
        self._last = 0.0
        if done:
            self._line(done, f" (resumed: {done} done before)")

    def _line(self, done, extra=""):
        rate = (done - self.start_done) / max(time.monotonic() - self.t0, 1e-9)
        eta = _fmt_duration((self.total - done) / rate) if rate > 0 else "?"
        text = (f"{self.what}: {done}/{self.total} images ({100 * done // max(self.total, 1)}%)"
                f", {rate:,.0f} img/s, ETA {eta}{extra}")
        if self.live:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        else:
            print(text, file=self.stream, flush=True)

    def update(self, done):
        tenth = 10 * done // max(self.total, 1)
        now = time.monotonic()
        if (self.live and now - self._last >= 0.2) or (not self.live and tenth > self._shown):
            self._shown, self._last = tenth, now
            self._line(done)

    def finish(self):
        if self.live:
            self._line(self.total)
            self.stream.write("\n")
        elif self._shown < 10:
            self._line(self.total)
