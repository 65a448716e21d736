"""What a training run is told: TrainConfig, and the defaults each model family trains well
with (the command line's help prints the same table)."""
import dataclasses

from .. import data, models
from ..dist import planner

SCHEDULES = ("constant", "step", "multistep", "cosine")


@dataclasses.dataclass
class TrainConfig:
    model: str = "lenet"
    variant: str = None
    num_classes: int = None
    dropout: float = None
    dataset: str = None
    data_dir: str = None
    augment: bool = None
    epochs: int = None
    max_steps: int = None
    batch_size: int = None
    lr: float = None
    momentum: float = None
    weight_decay: float = None
    nesterov: bool = False
    schedule: str = None
    step_epochs: int = 30
    milestones: tuple = ()
    gamma: float = 0.1
    warmup_epochs: float = None
    threads: int = None
    seed: int = 0
    log: str = None
    checkpoint_dir: str = None
    checkpoint_every: int = None    # steps; checkpoints are also written after every epoch
    keep_last: int = None
    resume: str = None              # a checkpoint, a folder (its last.ckpt), or "auto"
    eval_every: int = 1
    skip_nonfinite: bool = False
    stall_timeout: float = 300.0    # seconds; 0 turns the watchdog's stall check off
    sync: str = "dynamic"
    bucket_mb: float = planner.DEFAULT_BUCKET_MB
    compress: str = None
    trace: str = None
    data_workers: int = None
    skip_bad_images: bool = False
    batchnorm: str = "global"
    precision: str = "fp32"
    allow_precision_change: bool = False
    label_smoothing: float = 0.0
    clip_grad_norm: float = None
    accumulate: int = 1
    no_wd_bn_bias: bool = False
    log_every: int = None
    init_from: str = None
    init_from_head: str = "keep"
    eval_only: bool = False
    config: str = None          # the TOML file the settings came from, if any


# Hyper-parameters that train each family well (batch is the global batch).
FAMILY_DEFAULTS = {
    "lenet": dict(dataset="mnist-sample", epochs=20, batch_size=64, lr=0.01, momentum=0.9,
                  weight_decay=0.0, schedule="constant", warmup_epochs=0),
    "alexnet": dict(dataset="cifar10", epochs=30, batch_size=128, lr=0.01, momentum=0.9,
                    weight_decay=5e-4, schedule="cosine", warmup_epochs=0),
    "vgg": dict(dataset="cifar10", epochs=30, batch_size=128, lr=0.01, momentum=0.9,
                weight_decay=5e-4, schedule="cosine", warmup_epochs=0),
    "vgg_bn": dict(dataset="cifar10", epochs=30, batch_size=128, lr=0.05, momentum=0.9,
                   weight_decay=5e-4, schedule="cosine", warmup_epochs=1),
    "resnet": dict(dataset="cifar10", epochs=30, batch_size=128, lr=0.1, momentum=0.9,
                   weight_decay=5e-4, schedule="cosine", warmup_epochs=1),
}
# torchvision's ImageNet reference recipe, for image folders and packed sets (the learning
# rate stays the family's: 0.1 for ResNets, 0.01 for AlexNet and VGG).
IMAGE_DATA_DEFAULTS = dict(epochs=90, batch_size=256, weight_decay=1e-4, schedule="step",
                           warmup_epochs=0)
# Datasets augmented unless --no-augment: natural images (random crop + flip). A packed
# set says itself (a packed MNIST is not flipped): the trainer decides once it is open.
AUGMENTED_BY_DEFAULT = ("cifar10", "cifar100", "imagefolder")
_FAMILY_MODELS = {"lenet": "lenet", "alexnet": "alexnet", "vgg": "vgg*", "vgg_bn": "vgg*_bn",
                  "resnet": "resnet*"}


def family(model_name):
    if model_name.startswith("vgg"):
        return "vgg_bn" if model_name.endswith("_bn") else "vgg"
    for name in ("lenet", "alexnet", "resnet"):
        if model_name.startswith(name):
            return name
    return None


def with_defaults(cfg):
    """cfg with every unset field filled from its model family's defaults."""
    if cfg.model not in models.names():
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {', '.join(models.names())}")
    defaults = dict(FAMILY_DEFAULTS[family(cfg.model)])
    if cfg.variant == "imagenet" and cfg.dataset is None:
        # Never a silent fall-back to random data: the user says which.
        raise ValueError("--variant imagenet: name the data: --dataset imagefolder --data-dir "
                         "DIR (DIR/train/<class>/*.jpg), --dataset packed --data-dir DIR, or "
                         "--dataset synthetic for a throughput run on random data")
    if cfg.dataset in data.IMAGE_NAMES:
        defaults.update(IMAGE_DATA_DEFAULTS)
    filled = {k: (defaults[k] if getattr(cfg, k) is None and k in defaults else getattr(cfg, k))
              for k in (f.name for f in dataclasses.fields(cfg))}
    cfg = TrainConfig(**filled)
    if cfg.augment is None and cfg.dataset != "packed":
        cfg.augment = cfg.dataset in AUGMENTED_BY_DEFAULT
    for flag, value in (("--resume auto", cfg.resume == "auto"),
                        ("--checkpoint-every", cfg.checkpoint_every),
                        ("--keep-last", cfg.keep_last)):
        if value and cfg.checkpoint_dir is None:
            raise ValueError(f"{flag}: needs --checkpoint-dir")
    return cfg


def check_settings(cfg, world):
    """Settings that cannot go together, as one-line errors naming the flags."""
    if cfg.eval_only and not (cfg.init_from or cfg.resume):
        raise ValueError("--eval-only: give the weights to evaluate with --init-from or --resume")
    if cfg.eval_only and cfg.resume == "auto":
        raise ValueError("--eval-only: name the checkpoint to evaluate (--resume FILE or DIR), "
                         "not auto")
    if cfg.init_from and cfg.resume:
        raise ValueError("--init-from and --resume both give the starting weights: use one")
    if cfg.init_from_head == "new" and not cfg.init_from:
        raise ValueError("--init-from-head new: needs --init-from")
    if cfg.batch_size % (world * cfg.accumulate):
        raise ValueError(f"--accumulate {cfg.accumulate}: the global batch {cfg.batch_size} "
                         f"does not split into {world} rank(s) x {cfg.accumulate} equal "
                         f"micro-batches")


def defaults_table():
    """FAMILY_DEFAULTS as the lines of a table, for --help."""
    columns = ("batch_size", "lr", "momentum", "weight_decay", "schedule", "warmup_epochs",
               "epochs", "dataset")
    header = ("models", "batch", "lr", "momentum", "decay", "schedule", "warm-up", "epochs",
              "dataset")
    rows = [header] + [(_FAMILY_MODELS[name],) + tuple(f"{values[c]:g}" if isinstance(
        values[c], float) else str(values[c]) for c in columns)
        for name, values in FAMILY_DEFAULTS.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
