"""Reading files that declare their own sizes, in memory bounded by what they declare.

A compressed input can inflate to far more than its size on disk (an 8 MB gzip of zeros is
8 GB), and a damaged or hostile one can declare anything. So the sizes a file declares (a
zip member's uncompressed size, a .npy header's shape, an IDX header's dimensions) are
checked before anything is inflated: against each other, against the memory this machine
has free, and against what image data can compress to (MAX_INFLATION times its compressed
size, beyond INFLATION_FLOOR); and nothing is read past them. Used for .npz archives
(datasets and checkpoints) and gzip'd IDX files.
"""
import math
import os
import zipfile

import numpy as np

_CHUNK = 1 << 24          # bytes read per call while filling an array
# Images and labels compress a few times (MNIST's gzip: 4.7x, CIFAR's: 1.3x); only nearly
# constant data compresses 100x, and deflate's limit is ~1000x. Below the floor any ratio
# is fine: small files cannot do harm.
MAX_INFLATION = 100
INFLATION_FLOOR = 256 << 20


class DeclaredSizeError(ValueError):
    """A file's declared sizes are inconsistent, too large for this machine, or not what
    the data holds; the message names the member and the sizes, not the file."""


def available_memory():
    """Bytes of memory this machine can still give (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes, what):
    """DeclaredSizeError unless `nbytes` (what `what` declares) fits in free memory."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise DeclaredSizeError(f"{what} declares {_size(nbytes)} of data, more than the "
                                f"{_size(free)} of memory available")


def check_inflation(declared, compressed, what):
    """DeclaredSizeError if `declared` uncompressed bytes from `compressed` ones is more
    than image data inflates to (a decompression bomb)."""
    if declared > INFLATION_FLOOR and declared > MAX_INFLATION * max(compressed, 1):
        raise DeclaredSizeError(
            f"{what} declares {_size(declared)} from {_size(compressed)} compressed "
            f"({declared / max(compressed, 1):,.0f}x): more than images compress, so it is "
            f"refused; if the data is real, store it uncompressed (gunzip it, or np.savez "
            f"rather than np.savez_compressed)")


def read_into(stream, array, what):
    """Fill `array` (C-contiguous) from `stream`, then require the stream to end there."""
    view = memoryview(array.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:done + _CHUNK])
        if not got:
            raise DeclaredSizeError(f"{what} is truncated: {done} of {len(view)} bytes")
        done += got
    if stream.read(1):
        raise DeclaredSizeError(f"{what} holds more than the {len(view)} bytes it declares")


def read_npz(path, names=None, allow_compressed=True):
    """{name: array} for the members of the .npz at `path` (all, or those of `names` it
    holds), each checked before it is read: stored or deflated, a .npy header whose shape
    and dtype account for exactly the member's declared size, no objects (no pickle), and
    all of them together within free memory. Raises DeclaredSizeError, zipfile.BadZipFile,
    OSError or numpy's header errors (ValueError) for a damaged file."""
    with zipfile.ZipFile(path) as archive:
        members = {}
        for info in archive.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if names is None or name in names:
                members[name] = info
        headers, total = {}, 0
        for name, info in members.items():
            if info.compress_type not in ((zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
                                          if allow_compressed else (zipfile.ZIP_STORED,)):
                raise DeclaredSizeError(f"member {info.filename} is stored with zip method "
                                        f"{info.compress_type}, which this file must not use")
            with archive.open(info) as f:
                headers[name] = _npy_header(f, info)
            if info.compress_type != zipfile.ZIP_STORED:
                check_inflation(info.file_size, info.compress_size, f"member {info.filename}")
            total += headers[name][3]
        check_fits(total, f"{len(members)} array(s) of the archive")
        arrays = {}
        for name, info in members.items():
            shape, dtype, fortran, nbytes, offset = headers[name]
            array = np.empty(shape[::-1] if fortran else shape, dtype)
            with archive.open(info) as f:
                f.read(offset)
                read_into(f, array, f"member {info.filename}")
            arrays[name] = array.T if fortran else array
        return arrays


def _npy_header(stream, info):
    """(shape, dtype, fortran_order, data bytes, header bytes) of the .npy in `stream`,
    checked against the zip directory's declared size of `info`."""
    version = np.lib.format.read_magic(stream)
    read = {(1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise DeclaredSizeError(f"member {info.filename}: .npy format version {version}")
    shape, fortran, dtype = read(stream)
    if dtype.hasobject:
        raise DeclaredSizeError(f"member {info.filename} holds Python objects (pickle), "
                                f"which are not read")
    offset = stream.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes != info.file_size:
        raise DeclaredSizeError(f"member {info.filename}: its header describes "
                                f"{_size(nbytes)} of {dtype} {shape} but the archive declares "
                                f"{_size(info.file_size - offset)}")
    return shape, dtype, fortran, nbytes, offset


def _size(nbytes):
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} bytes"
