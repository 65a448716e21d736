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
from ..dist import planner, wire
from ..dist.data_parallel import BATCHNORM_MODES, NonFiniteError
from ..dist.job import CollectiveError, Job
from ..nn.precision import PRECISIONS
from .config import SCHEDULES, TrainConfig, defaults_table
from .loop import train
from . import preemption

_DEFAULTS = TrainConfig()

EPILOG = """\
defaults by model family (batch is the global batch; warm-up in epochs):
{defaults}
  image folders and packed sets train 90 epochs at batch 256, weight decay 1e-4, the step
  schedule (x0.1 every 30 epochs), as torchvision's ImageNet recipe. cifar10, cifar100,
  imagefolder and packed are augmented unless --no-augment; npz only with --augment.
  --variant imagenet needs --dataset named (imagefolder, packed, or synthetic for throughput).

data files (--data-dir, default ./data):
  mnist          train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-* (same names)
  fashion-mnist  the same four file names, in DIR or DIR/fashion-mnist
  cifar10        DIR/cifar-10-batches-bin/*.bin or DIR/cifar-10-batches-py/ (extracted archives)
  cifar100       DIR/cifar-100-python/ (train, test: the extracted python archive)
  npz            --data-dir FILE.npz holding x (N,C,H,W or N,H,W,C) and y (+ optional x_test, y_test)
  imagefolder    DIR/train/<class>/*.jpg|png|..., DIR/val/<class>/... (classes sorted by name);
                 train RandomResizedCrop + flip, eval Resize(size/0.875) + CenterCrop
  packed         DIR written by `python -m dynar.data pack SRC DIR` (shards, memory-mapped)

distributed: mpiexec -n 4 python -m dynar.train --model alexnet --variant cifar ...
  --batch-size stays the global batch; threads per rank default to OMP_NUM_THREADS, else
  SLURM_CPUS_PER_TASK, else the node's cores divided by the ranks on the node. Keep ranks on
  separate cores with `--map-by slot:PE=T --bind-to core` (Open MPI), or `--bind-to none`
  and let dynar's thread count do it. Slurm and the system MPI: docs/running-on-a-cluster.md.

stopping and requeueing: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) on any rank stops every rank
  after the current step; with --checkpoint-dir one checkpoint is written first. The same
  command with --resume auto continues the run (a fresh start when there is no checkpoint).

exit status:
  0    finished
  1    an error (one line on stderr; every rank exits)
  2    a command-line error
  {requeue}   stopped by a signal after writing a checkpoint: requeue the job (--resume auto)
  128+N stopped by signal N without a checkpoint to resume from (no --checkpoint-dir)
"""


class _Parser(argparse.ArgumentParser):
    where = ""      # what is being parsed, when not the command line: the --config file

    def error(self, message):
        # One line, no usage dump: the user fixes the flag and reruns.
        print(f"{self.prog}: error: {self.where}{message} (see --help)", file=sys.stderr)
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


def _fraction(text):
    value = _finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def build_parser():
    epilog = EPILOG.format(defaults="\n".join("  " + line for line in defaults_table()),
                           requeue=preemption.REQUEUE_EXIT)
    p = _Parser(prog="python -m dynar.train", description=__doc__, epilog=epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default=_DEFAULTS.model, choices=models.names(), metavar="NAME",
      help=f"architecture: {', '.join(models.names())} (default lenet)")
    a("--variant", choices=["cifar", "imagenet", "mnist"],
      help="input size: cifar (3x32x32) or imagenet (3x224x224); lenet has only mnist")
    a("--num-classes", type=_positive_int, help="output classes (default: the dataset's)")
    a("--dropout", type=_non_negative_float,
      help="dropout probability of the classifier (alexnet; default 0.5; 0 turns it off)")
    a("--dataset", choices=data.NAMES,
      help="mnist-sample (bundled, default for lenet), mnist, fashion-mnist, cifar10, "
           "cifar100, npz, imagefolder, packed, synthetic (seeded random data, for throughput)")
    a("--data-dir", help="where the dataset files are (see below)")
    a("--augment", dest="augment", action="store_true", default=None,
      help="random crop + flip (on by default for cifar10/100, imagefolder, packed; asks "
           "for it on npz)")
    a("--no-augment", dest="augment", action="store_false", default=None,
      help="turn the random crop + flip off")
    a("--data-workers", type=_non_negative_int, metavar="N",
      help="decode threads per rank for imagefolder/packed (0: decode on the training thread; "
           "default: the cores this rank's compute threads leave free, at least 1; the start "
           "line says the number)")
    a("--skip-bad-images", action="store_true",
      help="replace unreadable images by the next readable one of their class, counted in "
           "the log (default: stop with an error naming the file)")
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
    a("--step-epochs", type=_positive_int, default=_DEFAULTS.step_epochs, help="period of the step schedule")
    a("--milestones", type=_positive_int, nargs="+", default=(), help="epochs of multistep")
    a("--gamma", type=_positive_float, default=_DEFAULTS.gamma, help="decay factor of step/multistep")
    a("--warmup-epochs", type=_non_negative_float,
      help="linear learning-rate warm-up from lr/3, in epochs (fractions allowed)")
    a("--threads", type=_positive_int,
      help="compute threads per process, used as given (default: OMP_NUM_THREADS, else "
           "SLURM_CPUS_PER_TASK, else the node's cores divided by its ranks, never more than "
           "the CPUs the process may run on; the start line says which)")
    a("--seed", type=_non_negative_int, default=_DEFAULTS.seed,
      help="seed of initial weights, shuffling, augmentation")
    a("--log", metavar="FILE", help="append JSON lines: one per step and epoch, and a summary")
    a("--checkpoint-dir", metavar="DIR",
      help="write a checkpoint after every epoch and at the end (DIR/last.ckpt is the newest); "
           "one job at a time per DIR")
    a("--checkpoint-every", type=_positive_int, metavar="N",
      help="also write a checkpoint every N steps")
    a("--keep-last", type=_positive_int, metavar="K",
      help="keep only the K newest checkpoints in --checkpoint-dir (default: all)")
    a("--resume", metavar="PATH",
      help="continue from a checkpoint file or directory; auto: from the newest valid "
           "checkpoint in --checkpoint-dir, or start fresh when there is none")
    a("--eval-every", type=_non_negative_int, default=_DEFAULTS.eval_every, metavar="N",
      help="evaluate on the held-out split every N epochs (0: never)")
    a("--skip-nonfinite", action="store_true",
      help="skip the update of a step whose loss or gradient is inf/NaN (on every rank; "
           "counted in the log) instead of stopping with an error")
    a("--stall-timeout", type=_non_negative_float, default=_DEFAULTS.stall_timeout,
      metavar="SECONDS",
      help=f"end the job when some ranks have waited this long for others that do not "
           f"arrive, naming them (default {_DEFAULTS.stall_timeout:g}; 0: off)")
    a("--sync", choices=("dynamic",) + planner.MODES, default=_DEFAULTS.sync,
      help="gradient synchronization across ranks: dynamic (Dynamic Allreduce: planned "
           "buckets and algorithms, overlapped with backward; default), per-layer (blocking), "
           "fused (one allreduce after backward), buckets (fixed-size, overlapped)")
    a("--bucket-mb", type=_positive_float, default=_DEFAULTS.bucket_mb,
      help=f"bucket size for --sync buckets (and dynamic's first, measuring steps; "
           f"default {_DEFAULTS.bucket_mb:g})")
    a("--compress", choices=wire.FORMATS,
      help="16-bit gradients on the wire (float32 sums, error feedback); off by default")
    a("--trace", metavar="FILE",
      help="write a Chrome/Perfetto trace of every rank's steps: per-layer backward and "
           "per-bucket allreduce spans")
    a("--batchnorm", choices=BATCHNORM_MODES, default=_DEFAULTS.batchnorm,
      help="what BatchNorm normalizes over across ranks: global (the global batch, as "
           "PyTorch's SyncBatchNorm: the rank count never changes the result; default) or "
           "local (each rank's share, as DDP's default)")
    a("--precision", choices=PRECISIONS, default=_DEFAULTS.precision,
      help="bf16: convolutions and fully connected layers compute on bf16 operands with "
           "float32 sums; weights, gradients, their allreduce, BatchNorm, the loss and the "
           "optimizer stay float32 (no loss scaling needed). On a CPU without bf16 "
           "instructions dynar says so and runs fp32 (default fp32)")
    a("--allow-precision-change", action="store_true",
      help="let --resume continue a run saved in the other --precision (the weights are "
           "float32 either way)")
    recipe = p.add_argument_group("recipe")
    r = recipe.add_argument
    r("--label-smoothing", type=_fraction, default=_DEFAULTS.label_smoothing, metavar="EPS",
      help="cross-entropy against (1 - EPS) onehot + EPS / classes, as "
           "nn.CrossEntropyLoss(label_smoothing=EPS) (default 0)")
    r("--clip-grad-norm", type=_positive_float, metavar="MAX",
      help="scale the averaged gradient to a global 2-norm of at most MAX before each update "
           "(as torch.nn.utils.clip_grad_norm_; the same on every rank)")
    r("--accumulate", type=_positive_int, default=_DEFAULTS.accumulate, metavar="N",
      help="run each rank's share of the global batch as N micro-batches and average the "
           "gradients once per step (a global batch larger than memory allows; BatchNorm "
           "normalizes each micro-batch)")
    r("--no-wd-bn-bias", action="store_true",
      help="no weight decay on BatchNorm weights and biases or on any layer's bias")
    r("--log-every", type=_positive_int, metavar="N",
      help="print a progress line every N steps, also when output is not a terminal (default: "
           "a few per epoch off a terminal, a redrawn line on one)")
    r("--config", metavar="FILE.toml",
      help="read any of these flags from a TOML file (name = value, e.g. lr = 0.1, "
           "milestones = [30, 60], nesterov = true); flags on the command line override it")
    weights = p.add_argument_group("weights in and out")
    w = weights.add_argument
    w("--init-from", metavar="FILE",
      help="start from these weights: a state_dict with torchvision's names as .pth "
           "(PyTorch needed), .safetensors or .npz; strict: every missing, unexpected or "
           "mis-shaped name is listed")
    w("--init-from-head", choices=("keep", "new"), default=_DEFAULTS.init_from_head,
      help="new: keep the model's freshly initialized classifier instead of the file's "
           "(fine-tuning for another class count; default keep)")
    w("--eval-only", action="store_true",
      help="with --init-from or --resume: evaluate the held-out split (loss, top-1, top-5) "
           "and stop; nothing is trained or written")
    a("--debug", action="store_true", help="show the traceback on errors")
    return p


def _file_arguments(parser, path):
    """The settings of the TOML file at `path` as command-line arguments, to be put before
    the real ones so that those override them."""
    try:
        import tomllib
    except ImportError:                      # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            parser.error("--config needs Python 3.11 or later (tomllib), or `pip install tomli`")
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as exc:
        parser.error(f"--config {path}: cannot read ({exc.strerror or exc})")
    except tomllib.TOMLDecodeError as exc:
        parser.error(f"--config {path}: not valid TOML ({exc})")
    flags = {option: action for action in parser._actions for option in action.option_strings}
    argv = []
    for key, value in values.items():
        option = "--" + key.replace("_", "-")
        action = flags.get(option)
        if action is None or option in ("--config", "--help"):
            parser.error(f"--config {path}: {key!r} is not a setting of this command (the "
                         f"flags of --help, without the dashes)")
        where = f"--config {path}: {key}"
        if action.nargs == 0:                # on/off flags: true turns them on
            if not isinstance(value, bool):
                parser.error(f"{where}: expected true or false, got {value!r}")
            argv += [option] if value else []
        elif isinstance(value, (dict, bool)) or (isinstance(value, list) and action.nargs != "+"):
            parser.error(f"{where}: expected {'a list' if action.nargs == '+' else 'one value'}, "
                         f"got {value!r}")
        else:
            argv += [option] + [str(v) for v in (value if isinstance(value, list) else [value])]
    return argv


def parse_args(argv=None):
    """The command line (with the --config file's settings under it) as argparse's
    namespace."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    from_file = _file_arguments(parser, args.config)
    parser.where = f"--config {args.config}: "
    parser.parse_args(from_file)             # the file's own values checked, naming it
    parser.where = ""
    return parser.parse_args(from_file + list(sys.argv[1:] if argv is None else argv))


def config_from_args(args):
    fields = {f for f in TrainConfig.__dataclass_fields__}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv=None):
    args = parse_args(argv)
    job = None
    try:
        job = Job.start()
        result = train(config_from_args(args), job)
        summary = result.summary
        if summary is not None and summary.get("final_accuracy") is not None \
                and not args.eval_only:
            print(f"final held-out accuracy: {100 * summary['final_accuracy']:.2f}%")
        return preemption.exit_status(result.stopped_by, result.checkpoint is not None)
    except KeyboardInterrupt:
        if job is None or not job.distributed:
            print("interrupted", file=sys.stderr)
            return 130
        job.abort("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line (or a traceback)
        if args.debug:
            traceback.print_exc()
        known = isinstance(exc, (ValueError, OSError, RuntimeError, ImportError))
        message = f"error: {exc}" if known else f"error: {type(exc).__name__}: {exc}"
        if isinstance(exc, NonFiniteError):
            message += ": lower --lr, or pass --skip-nonfinite to skip such steps"
        if not args.debug:
            message += "" if known else " (--debug shows the traceback)"
        if job is None or not job.distributed:
            print(message, file=sys.stderr)
            return 1
        if isinstance(exc, CollectiveError):
            # Every rank stopped at the same point with this error: one says it, all exit.
            if job.rank == 0:
                print(message, file=sys.stderr, flush=True)
            return 1
        job.abort(message)
