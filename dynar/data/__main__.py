"""python -m dynar.data: pack a dataset into shards, or verify a packed set.

    python -m dynar.data pack SRC DEST [--size 256|keep] [--quality 90] [--encoding jpeg|raw]
    python -m dynar.data verify DEST

Errors are one line on stderr with a non-zero exit.
"""
import argparse
import sys

from . import packed, packer
from .dataset import DataError

_ARRAY_SOURCES = ("mnist", "fashion-mnist", "cifar10", "cifar100", "npz")


def _size(text):
    if text == "keep":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'keep', got {text}")
    return value


def _positive(kind):
    def parse(text):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dynar.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="pack an image folder (or an array dataset) into shards")
    a.add_argument("source", metavar="SRC",
                   help="image folder (SRC/train/<class>/..., SRC/val/<class>/...), or the "
                        "data dir of --dataset")
    a.add_argument("dest", metavar="DEST", help="folder to write the packed set into")
    a.add_argument("--dataset", default="imagefolder", choices=("imagefolder",) + _ARRAY_SOURCES,
                   help="what SRC holds (default imagefolder); array datasets are stored raw "
                        "at their own size")
    a.add_argument("--size", type=_size, default=packer.DEFAULT_SIZE,
                   help="resize photographs so the shorter side is SIZE (never enlarged); "
                        "'keep' stores them at their own size (default 256)")
    a.add_argument("--quality", type=int, default=packer.DEFAULT_QUALITY,
                   help="JPEG quality of resized images (default 90)")
    a.add_argument("--encoding", choices=packed.ENCODINGS, default="jpeg",
                   help="jpeg (default; unresized JPEGs copied as they are, unresized "
                        "lossless files raw) or raw uint8 pixels for every image")
    a.add_argument("--shard-mb", type=_positive(float), default=packer.DEFAULT_SHARD_MB,
                   help="shard size in MB (default 256)")
    a.add_argument("--workers", type=_positive(int),
                   help="encoding threads (default: the cores this process may use)")
    a.add_argument("--skip-bad-images", action="store_true",
                   help="leave unreadable images out (counted) instead of stopping")
    v = sub.add_parser("verify", help="check every record of a packed set against its CRC-32")
    v.add_argument("dest", metavar="DEST")
    p.add_argument("--debug", action="store_true", help="show the traceback on errors")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.command == "pack":
            skipped = packer.pack(args.source, args.dest, dataset=args.dataset, size=args.size,
                                  quality=args.quality, encoding=args.encoding,
                                  shard_mb=args.shard_mb, workers=args.workers,
                                  skip_bad=args.skip_bad_images)
            print(f"packed {args.source} into {args.dest}"
                  + (f" ({skipped} unreadable image(s) left out)" if skipped else ""))
        else:
            ds = packed.load(args.dest)
            counts = [f"{name} {split.verify()}" for name, split in
                      (("train", ds.train), ("val", ds.test)) if split is not None]
            print(f"{args.dest}: every record matches its CRC-32 ({', '.join(counts)} images)")
        return 0
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to continue)", file=sys.stderr)
        return 130
    except (DataError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
