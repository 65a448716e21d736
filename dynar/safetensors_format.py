"""The .safetensors file format, read and written with numpy alone.

A file is: 8 bytes, the header's length N as a little-endian uint64; N bytes of JSON, an
object mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} plus
an optional "__metadata__" object of strings (padded with spaces); then the tensors' bytes,
little-endian, row-major, `data_offsets` counted from the end of the header. The tensors
must tile that data without gaps or overlaps.

Reading checks every one of those rules and refuses a file that breaks one with a
SafetensorsError naming the path and the rule (no partial result, memory bounded by the
tensors themselves: a header that claims more than the file holds is refused first).
"""
import json
import math
import os
import struct

import numpy as np

# safetensors dtype names -> numpy dtypes (little-endian). BF16 has no numpy dtype: its
# values are read as float32 (bf16 is float32's top half) and cannot be written.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
_NAMES = {np.dtype(v).newbyteorder("<") if np.dtype(v).itemsize > 1 else np.dtype(v): k
          for k, v in DTYPES.items()}
# The reference implementation refuses larger headers; so does this one.
MAX_HEADER_BYTES = 100 << 20


class SafetensorsError(ValueError):
    """A .safetensors file is truncated, corrupt or breaks the format; one line naming it."""


def read(path):
    """(tensors, metadata): name -> numpy array in the file's order, and the "__metadata__"
    strings ({} if none)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{path}: not a .safetensors file ({size} bytes, shorter "
                                       f"than the 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{path}: header length {length} exceeds the file's "
                                       f"{size - 8} bytes after it (truncated, or not "
                                       f"safetensors)")
            header = _parse_header(path, f.read(length))
            data_start = 8 + length
            entries = _check_entries(path, header, size - data_start)
            tensors = {}
            for name, dtype, shape, begin, end in entries:
                f.seek(data_start + begin)
                raw = f.read(end - begin)
                if len(raw) != end - begin:
                    raise SafetensorsError(f"{path}: truncated in tensor {name!r}")
                tensors[name] = _decode(raw, dtype, shape)
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return tensors, header.get("__metadata__") or {}


def _parse_header(path, raw):
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"{path}: the header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsError(f"{path}: __metadata__ must map names to strings")
    return header


def _check_entries(path, header, data_bytes):
    """[(name, dtype name, shape, begin, end)] sorted by begin, every rule checked."""
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where}: needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES and dtype != "BF16":
            raise SafetensorsError(f"{where}: dtype {dtype!r} is not one of "
                                   f"{', '.join(sorted(DTYPES) + ['BF16'])}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SafetensorsError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        itemsize = 2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize
        expected = math.prod(shape) * itemsize
        if offsets[1] - offsets[0] != expected:
            raise SafetensorsError(f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, "
                                   f"its {dtype} shape {shape} needs {expected}")
        entries.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e[3], e[4]))
    position = 0
    for name, _, _, begin, end in entries:
        if begin != position:
            raise SafetensorsError(f"{path}: tensor {name!r} starts at byte {begin} of the data, "
                                   f"expected {position} (gap or overlap)")
        position = end
    if position != data_bytes:
        raise SafetensorsError(f"{path}: the tensors cover {position} bytes but the file holds "
                               f"{data_bytes} after the header (truncated or padded)")
    return entries


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _decode(raw, dtype, shape):
    if dtype == "BF16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, DTYPES[dtype]).astype(np.dtype(DTYPES[dtype]).newbyteorder("="),
                                                    copy=True).reshape(shape)


def write(f, tensors, metadata=None):
    """Write `tensors` (name -> numpy array) to the open binary file `f`, in their order;
    metadata: {str: str} for "__metadata__"."""
    header, arrays, position = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, value in tensors.items():
        array = np.asarray(value, order="C")     # (ascontiguousarray makes 0-d arrays 1-d)
        key = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
        if key not in _NAMES:
            raise TypeError(f"safetensors: tensor {name!r} has dtype {array.dtype}, which the "
                            f"format has no name for")
        array = array.astype(key, copy=False)
        header[name] = {"dtype": _NAMES[key], "shape": list(array.shape),
                        "data_offsets": [position, position + array.nbytes]}
        position += array.nbytes
        arrays.append(array)
    text = json.dumps(header, separators=(",", ":")).encode()
    # Padded with spaces so that the data starts 8-byte aligned, as the reference writer does.
    text += b" " * (-(8 + len(text)) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for array in arrays:
        f.write(array.tobytes())
