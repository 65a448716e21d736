"""`packed`: a dataset packed into shards, memory-mapped read-only (docs/data.md).

    DEST/meta.json              format, classes, normalisation, how it was packed, and per
                                split the record count, the index's SHA-256 and each
                                shard's size
    DEST/<split>.index.npy      one row per image (INDEX_DTYPE): shard, offset, length,
                                height, width, channels, encoding, label, crc32
    DEST/<split>-NNNNN.shard    the records back to back: JPEG files or raw HWC uint8

Shards are mapped with mmap(PROT_READ, MAP_SHARED): the ranks of a node read the same page
cache instead of each holding a copy. Opening checks that the index and the shards agree
(sizes, and records tiling each shard exactly); every record's CRC-32 is checked when it is
read. Writing (pack) is in packer.py.
"""
import hashlib
import json
import mmap
import os
import threading
import zlib

import numpy as np

from .dataset import DataError, ImageDataset
from .decode import Record

FORMAT = "dynar-packed-v1"
META = "meta.json"
ENCODINGS = ("raw", "jpeg")
INDEX_DTYPE = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("length", "<u4"),
                        ("height", "<u4"), ("width", "<u4"), ("channels", "<u1"),
                        ("encoding", "<u1"), ("label", "<i8"), ("crc32", "<u4")])


def index_name(split):
    return f"{split}.index.npy"


def shard_name(split, number):
    return f"{split}-{number:05d}.shard"


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class PackedSplit:
    """One split of a packed set: labels, and record(i) read from the mapped shards."""

    def __init__(self, root, split, info, num_classes):
        self.root, self.split = root, split
        path = os.path.join(root, index_name(split))
        try:
            index = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable index ({e})") from None
        if index.dtype != INDEX_DTYPE or index.ndim != 1:
            raise DataError(f"{path}: not a {FORMAT} index (dtype {index.dtype})")
        if file_sha256(path) != info.get("index_sha256"):
            raise DataError(f"{path}: its SHA-256 is not the one {META} records (the index "
                            f"was changed or belongs to another packed set)")
        if len(index) != info["records"]:
            raise DataError(f"{path}: {len(index)} records, {META} says {info['records']}")
        self.index = index
        self.shard_files = [os.path.join(root, s["file"]) for s in info["shards"]]
        _check_tiling(root, split, index, info["shards"], num_classes)
        self.labels = np.array(index["label"], np.int64)
        self._maps = {}
        self._lock = threading.Lock()

    def __len__(self):
        return len(self.labels)

    def _map(self, shard):
        m = self._maps.get(shard)
        if m is None:
            with self._lock:
                m = self._maps.get(shard)
                if m is None:
                    path = self.shard_files[shard]
                    try:
                        with open(path, "rb") as f:
                            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    except (OSError, ValueError) as e:
                        raise DataError(f"{path}: cannot map ({e})") from None
                    self._maps[shard] = m
        return m

    def record(self, i):
        row = self.index[i]
        shard, offset, length = int(row["shard"]), int(row["offset"]), int(row["length"])
        data = memoryview(self._map(shard))[offset:offset + length]
        name = f"{self.shard_files[shard]} record {i} (bytes {offset}-{offset + length})"
        if zlib.crc32(data) != int(row["crc32"]):
            raise DataError(f"{name}: CRC-32 mismatch (the shard is damaged or was replaced)")
        encoding = ENCODINGS[int(row["encoding"])]
        shape = (int(row["height"]), int(row["width"]), int(row["channels"]))
        return Record(name, data, encoding, shape if encoding == "raw" else None)

    def verify(self):
        """Read every record and check its CRC-32; returns the count."""
        for i in range(len(self)):
            self.record(i)
        return len(self)


def _check_tiling(root, split, index, shards, num_classes):
    """The index's records tile every shard exactly: offsets start at 0, each record starts
    where the previous one ends, the last ends at the shard's size, as meta.json records it
    and as the file on disk is."""
    where = os.path.join(root, index_name(split))
    sizes = []
    for s in shards:
        path = os.path.join(root, s["file"])
        try:
            actual = os.path.getsize(path)
        except OSError as e:
            raise DataError(f"{path}: missing shard ({e.strerror or e})") from None
        if actual != s["bytes"]:
            raise DataError(f"{path}: {actual} bytes, {META} says {s['bytes']} (truncated or "
                            f"replaced: repack)")
        sizes.append(actual)
    if not len(index):
        return
    shard, offset = index["shard"].astype(np.int64), index["offset"].astype(np.int64)
    end = offset + index["length"]
    if shard.min() < 0 or shard.max() >= len(shards) or np.any(np.diff(shard) < 0):
        raise DataError(f"{where}: shard numbers out of order or beyond the {len(shards)} "
                        f"shards of {META}")
    starts = np.r_[True, shard[1:] != shard[:-1]]
    expected = np.where(starts, 0, np.r_[0, end[:-1]])
    bad = np.flatnonzero(offset != expected)
    if bad.size:
        k = int(bad[0])
        raise DataError(f"{where}: record {k} starts at byte {offset[k]} of "
                        f"{shards[shard[k]]['file']}, where {expected[k]} was expected "
                        f"(the index disagrees with its shards)")
    last = np.r_[starts[1:], True]
    sizes = np.asarray(sizes, np.int64)
    ends_bad = np.flatnonzero(end[last] != sizes[shard[last]])
    if ends_bad.size or len(np.unique(shard)) != len(shards):
        raise DataError(f"{where}: the records do not end where the shards do (the index "
                        f"disagrees with its shards)")
    raw = index["encoding"] == 0
    pixels = index["height"].astype(np.int64) * index["width"] * index["channels"]
    if np.any(raw & (index["length"] != pixels)) or np.any(index["encoding"] >= len(ENCODINGS)):
        raise DataError(f"{where}: a raw record's length is not height x width x channels")
    if index["label"].min() < 0 or index["label"].max() >= num_classes:
        raise DataError(f"{where}: labels outside 0-{num_classes - 1}")


def read_meta(root):
    path = os.path.join(root, META)
    if not os.path.exists(path):
        pending = os.path.isdir(os.path.join(root, ".pack"))
        raise DataError(f"{path}: missing" + (" (packing was interrupted: rerun "
                        "`python -m dynar.data pack` to finish it)" if pending else
                        " (not a packed set: make one with python -m dynar.data pack)"))
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} packed set")
    return meta


def load(data_dir):
    """The packed set at data_dir (meta.json checked against its index and shards)."""
    if data_dir is None:
        raise DataError("packed: pass the packed set's folder as --data-dir")
    meta = read_meta(data_dir)
    try:
        classes = list(meta["classes"])
        splits = {name: PackedSplit(data_dir, name, info, len(classes))
                  for name, info in meta["splits"].items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{os.path.join(data_dir, META)}: malformed ({type(e).__name__}: {e})") \
            from None
    train = splits.get("train")
    if train is None:
        raise DataError(f"{os.path.join(data_dir, META)}: no train split")
    kind = meta["kind"]
    shape = tuple(meta["shape"]) if kind == "array" else (3, 224, 224)
    notes = [] if "val" in splits else [f"{data_dir}: no val split: nothing to evaluate on"]
    return ImageDataset(name=f"packed:{meta['name']}", train=train, test=splits.get("val"),
                        classes=classes, mean=tuple(meta["mean"]), std=tuple(meta["std"]),
                        kind=kind, input_shape=shape, source=os.path.abspath(data_dir),
                        notes=notes, augment_by_default=bool(meta.get("augment_by_default",
                                                                      True)))
