"""Checkpoints: a nested dict of numpy arrays and plain Python values, saved atomically.

Container: an uncompressed .npz (zip) with no pickle anywhere:
  meta.npy  JSON {"format": "dynar-checkpoint", "version": 1, "sha256": ...}
  tree.npy  JSON describing the nested structure; arrays appear as references "a0", "a1", ...
  a<k>.npy  the arrays, dtype and shape preserved
The SHA-256 covers the tree and every array's dtype, shape and bytes, so a truncated or
corrupted file is detected at load instead of silently resuming from bad weights. Members are
stored, never compressed, and read within their declared sizes (dynar/bounded_read.py).

Structure encoding: JSON scalars (None, bool, int, float incl. nan/inf, str) stand for
themselves; containers and arrays are one-key objects: {"dict": [[key, node], ...]} (keys str
or int, order kept), {"list": [...]}, {"tuple": [...]}, {"array": "a3"} for an ndarray,
{"scalar": "a3"} for a numpy scalar (stored 0-d to keep its dtype).
"""
import hashlib
import json
import os
import shutil

import numpy as np

from .atomic_write import replace_atomically
from .bounded_read import read_npz

FORMAT = "dynar-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or corrupt; the message is one line naming the path."""


def save(path, state):
    """Write state (a dict) to path atomically: path holds either the old or the new checkpoint.

    The data goes to a hidden temporary file in the same directory (same filesystem, so the
    rename is atomic), is fsync'ed, renamed over path, and the directory is fsync'ed so the
    rename itself survives a crash. If anything fails, the temporary file is removed.
    """
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
    arrays = {}
    tree = json.dumps(_encode(state, arrays, "state")).encode()
    members = {"tree": np.frombuffer(tree, np.uint8), **arrays}
    meta = {"format": FORMAT, "version": VERSION, "sha256": _digest(tree, arrays)}
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)

    def write(tmp):
        with open(tmp, "xb") as f:
            np.savez(f, **members)
            f.flush()
            os.fsync(f.fileno())

    replace_atomically(os.fspath(path), write)


def link_as_last(path):
    """Make last.ckpt beside the checkpoint at path the same checkpoint, atomically: a hard
    link (a copy where the filesystem has none) renamed over it. Serializing the state a
    second time instead left last.ckpt an epoch behind when interrupted in between."""
    path = os.fspath(path)

    def link(tmp):
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)

    replace_atomically(os.path.join(os.path.dirname(os.path.abspath(path)), "last.ckpt"), link)


def load(path):
    """The dict saved at path; CheckpointError if it is missing, truncated or corrupt."""
    path = os.fspath(path)
    meta, _ = _read(path, ("meta", "tree"))
    arrays = _read(path, None)
    tree, arrays = arrays.pop("tree").tobytes(), {k: v for k, v in arrays.items() if k != "meta"}
    if _digest(tree, arrays) != meta.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch, the checkpoint is corrupt")
    try:
        return _decode(json.loads(tree), arrays)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: malformed structure ({_one_line(e)})") from None


def peek(path):
    """The dict saved at path with every array left out (None in its place): a checkpoint's
    plain values (its position, its settings) without reading its arrays or verifying its
    checksum. CheckpointError if that much cannot be read."""
    path = os.fspath(path)
    _, tree = _read(path, ("meta", "tree"))
    try:
        return _decode(json.loads(tree), _Absent())
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: malformed structure ({_one_line(e)})") from None


class _Absent(dict):
    def __missing__(self, key):
        return None


def _read(path, names):
    """(meta, tree bytes) after checking the format and version, for names ("meta",
    "tree"); else every member {name: array}."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    if _starts_with(path, b"\x93NUMPY"):
        raise CheckpointError(f"{path}: not a dynar checkpoint (a bare .npy array)")
    try:
        members = read_npz(path, names, allow_compressed=False)
        if not {"meta", "tree"} <= set(members):
            raise CheckpointError(f"{path}: not a dynar checkpoint (no meta/tree entries)")
        meta = json.loads(members["meta"].tobytes())
    except CheckpointError:
        raise
    except Exception as e:
        # Damaged bytes make zipfile, numpy's .npy header parser or json raise nearly
        # anything (BadZipFile, NotImplementedError, tokenize.TokenError, ...); all of them
        # mean the same thing here.
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint ({_one_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dynar checkpoint (format "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')}, "
                              f"this dynar reads version {VERSION}")
    if names is None:
        return members
    return meta, members["tree"].tobytes()


def _starts_with(path, magic):
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _encode(node, arrays, where):
    """JSON-able description of node; arrays are moved into `arrays` under fresh names."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, (np.ndarray, np.generic)):
        array = np.asarray(node)
        if array.dtype.hasobject:
            raise TypeError(f"{where}: object arrays cannot be checkpointed without pickle")
        name = f"a{len(arrays)}"
        arrays[name] = array
        return {"array" if isinstance(node, np.ndarray) else "scalar": name}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{where}: dict key {key!r} is not a str or int")
        return {"dict": [[k, _encode(v, arrays, f"{where}[{k!r}]")] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        items = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(node)]
        return {"list" if isinstance(node, list) else "tuple": items}
    raise TypeError(f"{where}: cannot checkpoint a {type(node).__name__}")


def _decode(node, arrays):
    if not isinstance(node, dict):
        return node
    (kind, value), = node.items()
    if kind == "dict":
        return {k: _decode(v, arrays) for k, v in value}
    if kind == "list":
        return [_decode(v, arrays) for v in value]
    if kind == "tuple":
        return tuple(_decode(v, arrays) for v in value)
    if kind == "array":
        return arrays[value]
    if kind == "scalar":
        return arrays[value][()]
    raise ValueError(f"unknown node kind {kind!r}")


def _digest(tree, arrays):
    h = hashlib.sha256(tree)
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        h.update(array.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _one_line(error):
    return " ".join(str(error).split())
