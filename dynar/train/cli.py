"""python -m dynar.train: train a CNN on one process or, under mpiexec, on many.

With no arguments it trains LeNet on 4,000 real MNIST digits bundled with the install and
reports held-out accuracy on 1,000 more. Errors are one line on stderr with a non-zero exit
(--debug shows the traceback); under mpiexec a failing rank ends the whole job.
"""
import argparse
import math
import sys
import traceback

from .. import data, models
from ..dist import wire
from ..dist.job import Job
from .loop import SCHEDULES, TrainConfig, train

EPILOG = """\
defaults by model family (global batch / lr / momentum / weight decay / schedule / epochs):
  lenet     64 / 0.01 / 0.9 / 0    / constant / 20, on mnist-sample
  alexnet  128 / 0.01 / 0.9 / 5e-4 / cosine   / 30, on cifar10 (augmented)
  vgg*     128 / 0.01 (0.05 for *_bn, 1 warm-up epoch) / 0.9 / 5e-4 / cosine / 30, on cifar10
  resnet*  128 / 0.1, 1 warm-up epoch / 0.9 / 5e-4 / cosine / 30, on cifar10
  imagenet variants default to --dataset synthetic (throughput runs).

data files (--data-dir, default ./data):
  mnist          train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-* (same names)
  fashion-mnist  the same four file names, in DIR or DIR/fashion-mnist
  cifar10        DIR/cifar-10-batches-bin/*.bin or DIR/cifar-10-batches-py/ (extracted archives)
  npz            --data-dir FILE.npz holding x (N,C,H,W or N,H,W,C) and y (+ optional x_test, y_test)

distributed: mpiexec -n 4 python -m dynar.train --model alexnet --variant cifar ...
  --batch-size stays the global batch; threads per rank default to the node's cores divided by
  the ranks on the node. Keep ranks on separate cores with `--map-by slot:PE=T --bind-to core`
  (Open MPI), or `--bind-to none` and let dynar's thread count do it.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line, no usage dump: the user fixes the flag and reruns.
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _non_negative_float(text):
    value = _finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text):
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser():
    p = _Parser(prog="python -m dynar.train", description=__doc__, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="lenet", choices=models.names(), metavar="NAME",
      help=f"architecture: {', '.join(models.names())} (default lenet)")
    a("--variant", choices=["cifar", "imagenet", "mnist"],
      help="input size: cifar (3x32x32) or imagenet (3x224x224); lenet has only mnist")
    a("--num-classes", type=_positive_int, help="output classes (default: the dataset's)")
    a("--dropout", type=_non_negative_float,
      help="dropout probability of the classifier (alexnet; default 0.5; 0 turns it off)")
    a("--dataset", choices=data.NAMES,
      help="mnist-sample (bundled, default for lenet), mnist, fashion-mnist, cifar10, npz, "
           "synthetic (seeded random data, for throughput)")
    a("--data-dir", help="where the dataset files are (see below)")
    a("--no-augment", dest="augment", action="store_false", default=None,
      help="turn off CIFAR-10 random crop + flip (on by default for cifar10)")
    a("--epochs", type=_positive_int, help="passes over the training set")
    a("--max-steps", type=_positive_int, help="stop after this many steps in all (checkpointed)")
    a("--batch-size", type=_positive_int,
      help="GLOBAL batch size, split evenly over the ranks (must be divisible by them)")
    a("--lr", type=_positive_float, help="peak learning rate")
    a("--momentum", type=_non_negative_float, help="SGD momentum")
    a("--nesterov", action="store_true", help="Nesterov momentum")
    a("--weight-decay", type=_non_negative_float, help="L2 weight decay")
    a("--schedule", choices=SCHEDULES,
      help="learning-rate schedule: constant, step (x gamma every --step-epochs), multistep "
           "(x gamma at --milestones), cosine (to 0 over the run)")
    a("--step-epochs", type=_positive_int, default=30, help="period of the step schedule")
    a("--milestones", type=_positive_int, nargs="+", default=(), help="epochs of multistep")
    a("--gamma", type=_positive_float, default=0.1, help="decay factor of step/multistep")
    a("--warmup-epochs", type=_non_negative_float,
      help="linear learning-rate warm-up from lr/3, in epochs (fractions allowed)")
    a("--threads", type=_positive_int,
      help="compute threads per process (default: OMP_NUM_THREADS or the cores this process "
           "may use; under mpiexec the node's cores divided by its ranks)")
    a("--seed", type=_non_negative_int, default=0,
      help="seed of initial weights, shuffling, augmentation")
    a("--log", metavar="FILE", help="append JSON lines: one per step and epoch, and a summary")
    a("--checkpoint-dir", metavar="DIR",
      help="write a checkpoint after every epoch and at the end (DIR/last.ckpt is the newest)")
    a("--resume", metavar="PATH", help="continue from a checkpoint file or directory")
    a("--eval-every", type=_non_negative_int, default=1, metavar="N",
      help="evaluate on the held-out split every N epochs (0: never)")
    a("--sync", choices=["dynamic", "per-layer", "fused", "buckets"], default="dynamic",
      help="gradient synchronization across ranks: dynamic (Dynamic Allreduce: planned "
           "buckets and algorithms, overlapped with backward; default), per-layer (blocking), "
           "fused (one allreduce after backward), buckets (fixed-size, overlapped)")
    a("--bucket-mb", type=_positive_float, default=25.0,
      help="bucket size for --sync buckets (and dynamic's first, measuring steps)")
    a("--compress", choices=wire.FORMATS,
      help="16-bit gradients on the wire (float32 sums, error feedback); off by default")
    a("--trace", metavar="FILE",
      help="write a Chrome/Perfetto trace of every rank's steps: per-layer backward and "
           "per-bucket allreduce spans")
    a("--debug", action="store_true", help="show the traceback on errors")
    return p


def config_from_args(args):
    fields = {f for f in TrainConfig.__dataclass_fields__}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv=None):
    args = build_parser().parse_args(argv)
    job = None
    try:
        job = Job.start()
        summary = train(config_from_args(args), job).summary
        if summary is not None and summary.get("final_accuracy") is not None:
            print(f"final held-out accuracy: {100 * summary['final_accuracy']:.2f}%")
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line (or a traceback)
        if args.debug:
            traceback.print_exc()
        known = isinstance(exc, (ValueError, OSError, RuntimeError, ImportError))
        message = f"error: {exc}" if known else f"error: {type(exc).__name__}: {exc}"
        if not args.debug:
            message += "" if known else " (--debug shows the traceback)"
        if job is None:
            print(message, file=sys.stderr)
            return 1
        job.abort(message)
