"""python -m dynar.export CHECKPOINT OUT: the model weights of a training checkpoint as a
state_dict with torchvision's names, in the format OUT's extension names: .safetensors (no
PyTorch needed), .pth (PyTorch's own; needs torch) or .npz.

An ImageNet variant loads with load_state_dict(strict=True) into the torchvision model of
the same name; a CIFAR variant into the PyTorch definition in docs/PYTORCH.md. Errors are
one line on stderr and a non-zero exit; OUT is written atomically or not at all.
"""
import argparse
import os
import sys

from . import checkpoint, weights
from .train import state as train_state


def export(checkpoint_path, out):
    """Write the checkpoint's weights to `out`; returns (config, number of tensors,
    number of parameters) for the report."""
    path = checkpoint_path
    if os.path.isdir(path):
        path = os.path.join(path, "last.ckpt")
    saved = checkpoint.load(path)
    if saved.get("format") != train_state.FORMAT:
        raise checkpoint.CheckpointError(f"{path}: not a dynar training checkpoint")
    config, model = saved["config"], saved["model"]
    weights.file_format(out)       # refuse an unknown extension before any work
    metadata = {"model": config["model"], "variant": str(config.get("variant")),
                "num_classes": str(config["num_classes"]), "written_by": "dynar.export"}
    weights.write_state_dict(out, model, metadata)
    parameters = sum(v.size for k, v in model.items()
                     if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    return config, len(model), parameters


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dynar.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint file, or a --checkpoint-dir (its last.ckpt)")
    parser.add_argument("out", metavar="OUT",
                        help="the file to write: .safetensors, .pth (or .pt) or .npz")
    args = parser.parse_args(argv)
    try:
        config, tensors, parameters = export(args.checkpoint, args.out)
    except (ValueError, OSError) as exc:
        print(f"python -m dynar.export: error: {exc}", file=sys.stderr)
        return 1
    variant = config.get("variant") or "default"
    print(f"wrote {args.out}: {config['model']} ({variant} variant, {config['num_classes']} "
          f"classes), {tensors} tensors, {parameters:,} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
