"""Bad input stays bounded: compressed files that would inflate past what they declare, or past
what images can compress to, are refused before they are inflated, in seconds and in little
memory (measured in a process of its own); labels that would make a billion classes, and
arrays in the other byte order, are refused or converted."""
import gzip
import os
import struct
import subprocess
import sys
import time
import zipfile
import zlib

import numpy as np
import pytest

from dynar import checkpoint, data, models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20

# The peak is VmHWM, which exec resets: getrusage's ru_maxrss keeps the forking parent's
# (pytest's, over 1 GB late in the suite).
LOAD = """
import sys, time
from dynar import data
start = time.monotonic()
try:
    data.load(sys.argv[1], data_dir=sys.argv[2])
    print("loaded")
except data.DataError as exc:
    print(f"DataError: {exc}")
seconds = time.monotonic() - start
with open("/proc/self/status") as status:
    peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(peak_kb // 1024, seconds)
"""


def load_in_a_process(dataset, path):
    """(outcome line, peak RSS in MB, seconds the load took) of data.load in a fresh process."""
    done = subprocess.run([sys.executable, "-c", LOAD, dataset, str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    outcome, figures = done.stdout.strip().splitlines()[-2:]
    peak, seconds = figures.split()
    return outcome, int(peak), float(seconds)


def deflated_zeros(nbytes, prefix=b""):
    """A raw deflate stream of `prefix` then `nbytes` zero bytes, built from one compressed
    megabyte repeated (a full flush makes every repeat the same bytes): ~1 KB per MB."""
    block = bytes(MB)
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = co.compress(prefix + block) + co.flush(zlib.Z_FULL_FLUSH)
    rest = co.compress(block) + co.flush(zlib.Z_FULL_FLUSH)
    return first + rest * (nbytes // MB - 1) + co.flush()


def gzip_of(stream, nbytes):
    # The trailer's CRC is left 0: a reader that inflated it all would fail only at the end.
    return b"\x1f\x8b\x08\0\0\0\0\0\0\xff" + stream + struct.pack("<II", 0, nbytes & 0xFFFFFFFF)


def mnist_with_images(folder, images_gz):
    """A complete MNIST folder whose training images are the given .gz bytes."""
    rng = np.random.default_rng(0)
    for stem, array in (("train-labels-idx1-ubyte", rng.integers(0, 10, 20)),
                        ("t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28))),
                        ("t10k-labels-idx1-ubyte", rng.integers(0, 10, 10))):
        array = np.asarray(array, np.uint8)
        header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
        (folder / stem).write_bytes(header + array.tobytes())
    (folder / "train-images-idx3-ubyte.gz").write_bytes(images_gz)


def idx3_header(n):
    return bytes([0, 0, 8, 3]) + np.asarray([n, 28, 28], ">u4").tobytes()


@pytest.mark.parametrize("case, words", [
    # 8 GB of zeros in an 8 MB gzip: not even an IDX header
    ("zeros", "wrong magic number"),
    # a valid header declaring 10^7 images (7.3 GB), then as many zeros
    ("declared", "more than images compress"),
    # a header for 20 images, followed by 8 GB more
    ("trailing", "holds more than the 15680 bytes it declares"),
])
def test_a_gzip_bomb_is_refused_without_inflating_it(tmp_path, case, words):
    if case == "zeros":
        images = gzip_of(deflated_zeros(8 << 30), 8 << 30)
    elif case == "declared":
        images = gzip_of(deflated_zeros(7 << 30, idx3_header(10 ** 7)), 7 << 30)
    else:
        images = gzip_of(deflated_zeros(8 << 30, idx3_header(20)), 8 << 30)
    assert len(images) < 9 * MB
    mnist_with_images(tmp_path, images)
    outcome, peak, seconds = load_in_a_process("mnist", tmp_path)
    assert outcome.startswith("DataError: ") and words in outcome, outcome
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in outcome
    assert peak < 400 and seconds < 10, (peak, seconds)


def npz_member(archive, name, payload, declared, crc=0):
    """Write `payload` (raw deflate bytes) into the open file `archive` as a zip member that
    declares `declared` uncompressed bytes; returns its central directory record."""
    offset = archive.tell()
    fields = struct.pack("<HHHHHIIIHH", 20, 0, 8, 0, 0, crc, len(payload), declared,
                         len(name), 0)
    archive.write(b"PK\x03\x04" + fields + name + payload)
    return (b"PK\x01\x02" + struct.pack("<H", 20) + fields + struct.pack("<HHHII", 0, 0, 0, 0,
                                                                          offset) + name)


def write_npz(path, members):
    """A zip file of (name, raw deflate payload, declared size) members."""
    with open(path, "wb") as f:
        directory = [npz_member(f, name, payload, declared) for name, payload, declared in members]
        start = f.tell()
        f.write(b"".join(directory))
        f.write(b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(directory), len(directory),
                                            f.tell() - start, start, 0))


def npy_header(shape, dtype="|u1"):
    text = repr({"descr": dtype, "fortran_order": False, "shape": shape})
    text += " " * (63 - (10 + len(text)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode()


def test_an_npz_bomb_is_refused_without_inflating_it(tmp_path):
    # x.npy declares 512 MB of images (its header agrees), all zeros, in ~0.5 MB.
    header = npy_header((2 ** 19, 1, 32, 32))
    size = len(header) + (512 << 20)
    labels = zlib.compressobj(9, zlib.DEFLATED, -15)
    y_header = npy_header((4,), "<i8")
    y = labels.compress(y_header + bytes(32)) + labels.flush()
    path = tmp_path / "bomb.npz"
    write_npz(path, [(b"x.npy", deflated_zeros(512 << 20, header), size),
                     (b"y.npy", y, len(y_header) + 32)])
    outcome, peak, seconds = load_in_a_process("npz", path)
    assert "member x.npy declares 512.0 MB" in outcome and "more than images compress" in outcome
    assert peak < 400 and seconds < 10, (peak, seconds)


def test_an_npz_whose_sizes_disagree_is_refused_before_reading(tmp_path):
    # The zip directory says 64 MB, the .npy header describes 16 bytes: one of them lies.
    header = npy_header((16,))
    path = tmp_path / "liar.npz"
    write_npz(path, [(b"x.npy", deflated_zeros(64 << 20, header), 64 << 20)])
    with pytest.raises(data.DataError, match="its header describes 16 bytes of uint8 .16,. but "
                                             "the archive declares"):
        data.load("npz", data_dir=str(path))


def test_labels_that_would_make_a_billion_classes_are_an_error(tmp_path):
    path = tmp_path / "labels.npz"
    y = np.zeros(40, np.int64)
    y[7] = 10 ** 9
    np.savez(path, x=np.zeros((40, 1, 8, 8), np.uint8), y=y)
    start = time.monotonic()
    with pytest.raises(data.DataError, match="1000000001 classes for 40 samples; pass "
                                             "--num-classes"):
        data.load("npz", data_dir=str(path))
    assert time.monotonic() - start < 5


def test_arrays_in_the_other_byte_order_are_converted_where_read_and_refused_by_kernels(
        tmp_path, rng):
    x = rng.standard_normal((40, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 40)
    np.savez(tmp_path / "big.npz", x=x.astype(">f4"), y=y.astype(">i8"))
    np.savez(tmp_path / "little.npz", x=x, y=y)
    big = data.load("npz", data_dir=str(tmp_path / "big.npz"))
    little = data.load("npz", data_dir=str(tmp_path / "little.npz"))
    assert big.x_train.dtype.isnative and big.y_train.dtype.isnative
    np.testing.assert_array_equal(big.x_train, little.x_train)
    np.testing.assert_array_equal(big.y_train, little.y_train)
    # A model fed such an array directly: a TypeError naming it, as PyTorch's from_numpy.
    with pytest.raises(TypeError, match="x: expected native byte order, got >f4"):
        models.get("lenet").forward(x[:2].astype(">f4"))


def test_a_checkpoint_with_a_compressed_member_is_refused(tmp_path):
    # dynar writes checkpoints uncompressed; a deflated member could hold a bomb.
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, {"model": {"w": np.zeros(1000, np.float32)}})
    with np.load(path) as archive:
        members = {name: archive[name] for name in archive.files}
    with open(path, "wb") as f:                   # (a file name would gain ".npz")
        np.savez_compressed(f, **members)
    with pytest.raises(checkpoint.CheckpointError, match="zip method 8"):
        checkpoint.load(path)


def test_a_readable_gzip_still_reads(tmp_path):
    # The bounded reader against the real format: 20 images, gzip'd by Python's own gzip.
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)
    mnist_with_images(tmp_path, gzip.compress(idx3_header(20) + images.tobytes()))
    np.testing.assert_array_equal(data.load("mnist", data_dir=str(tmp_path)).x_train[:, 0],
                                  images)
