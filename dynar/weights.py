"""Model weights in the files other programs read and write: a state_dict with torchvision's
names as .safetensors (dynar/safetensors_format.py, no dependency), .npz (numpy) or .pth
(PyTorch's own format, read and written with torch where it is installed).

    state = read_state_dict("resnet18.pth")          # name -> numpy array
    load_weights(model, "resnet18.pth")              # strict: every mismatch listed
    load_weights(model, path, new_head=True)         # fine-tuning: the classifier kept fresh
    write_state_dict("out.safetensors", model.state_dict(), metadata={...})

A .pth may hold the state_dict itself or, as training scripts save it, a dict with the
state_dict under "model" or "state_dict"; names saved from DistributedDataParallel's
wrapper ("module." in front of each) are taken without it.
"""
import os

import numpy as np

from . import safetensors_format
from .atomic_write import replace_atomically

FORMATS = (".safetensors", ".npz", ".pth")


class WeightsError(ValueError):
    """A weights file cannot be read or written, or does not fit the model; one line."""


def file_format(path):
    """The weights format `path` names by its extension, or WeightsError."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext == ".pt":
        ext = ".pth"
    if ext not in FORMATS:
        raise WeightsError(f"{path}: unknown weights format {ext or '(no extension)'!r}; "
                           f"give a {', '.join(FORMATS)} (or .pt) file")
    return ext


def _torch(path, doing):
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{path}: {doing} a .pth file needs PyTorch (pip install torch); "
                           f"without it use .safetensors or .npz") from None
    return torch


def read_state_dict(path):
    """name -> numpy array of the weights file at `path` (by its extension)."""
    path = os.fspath(path)
    kind = file_format(path)
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file")
    if kind == ".safetensors":
        try:
            return safetensors_format.read(path)[0]
        except safetensors_format.SafetensorsError as exc:
            raise WeightsError(str(exc)) from None
    if kind == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        except Exception as exc:   # noqa: BLE001 - zip/npy parsing raises anything on damage
            raise WeightsError(f"{path}: not a readable .npz file ({_one_line(exc)})") from None
    torch = _torch(path, "reading")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:       # noqa: BLE001 - unpickling errors of every kind
        raise WeightsError(f"{path}: not a readable PyTorch file ({_one_line(exc)})") from None
    return _from_torch(path, torch, state)


def _from_torch(path, torch, state):
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict) and not any(
                isinstance(v, torch.Tensor) for v in state.values()):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: holds no state_dict (a dict of tensors, or one under "
                           f"'model' or 'state_dict')")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    # bfloat16 has no numpy dtype: float32 holds it exactly.
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
            for k, v in state.items()}


def write_state_dict(path, state, metadata=None):
    """Write `state` (name -> numpy array) to `path` atomically, in the format its extension
    names; metadata ({str: str}) goes into a .safetensors header."""
    path = os.fspath(path)
    kind = file_format(path)
    torch = _torch(path, "writing") if kind == ".pth" else None

    def write(tmp):
        with open(tmp, "xb") as f:
            if kind == ".safetensors":
                safetensors_format.write(f, state, metadata)
            elif kind == ".npz":
                np.savez(f, **state)
            else:
                torch.save({k: torch.from_numpy(np.asarray(v, order="C"))
                            for k, v in state.items()}, f)
            f.flush()
            os.fsync(f.fileno())

    try:
        replace_atomically(path, write)
    except OSError as exc:
        raise WeightsError(f"{path}: cannot write ({exc.strerror or exc})") from None


def head(model):
    """(layer name, its state_dict keys) of the model's classifier: the last layer with
    parameters, which backward finalizes first."""
    layer, params, _, _ = model.grad_ready_order()[0]
    return layer, params


def load_weights(model, path, new_head=False, what=None):
    """Copy the weights file at `path` into `model` (strict: nothing is copied unless every
    name and shape fits; the error lists what does not). new_head keeps the model's own
    freshly initialized classifier whatever the file holds for it (another class count).
    what: how the error names the model."""
    state = read_state_dict(path)
    missing_ok = ()
    if new_head:
        _, missing_ok = head(model)
        state = {k: v for k, v in state.items() if k not in missing_ok}
    try:
        model.load_state_dict(state, strict=True, missing_ok=missing_ok)
    except ValueError as exc:
        hint = "" if new_head else (" (--init-from-head new re-initializes the classifier "
                                    "for another class count)")
        raise WeightsError(f"{path}: does not fit {what or type(model).__name__}: "
                           f"{_problems(exc)}{hint if head(model)[1][0] in str(exc) else ''}"
                           ) from None
    return state


def _problems(exc):
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("load_state_dict into ") else text


def _one_line(error):
    return " ".join(str(error).split())
