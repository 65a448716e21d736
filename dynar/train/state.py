"""A training run in a checkpoint: what one holds, how a run continues from one, and which
settings a resumed run must share with the saved one.

The container (atomic, checksummed) is dynar/checkpoint.py's; this is its content."""
import dataclasses
import os
import tempfile

from .. import checkpoint
from ..nn import precision

FORMAT = "dynar-train-v1"

# What a resumed run must share with the saved one to continue it: the model, the data and
# its order, and every hyper-parameter of the optimizer, its schedule and the recipe.
# --max-steps, logging, threads and sync may differ. A checkpoint saved before a setting
# existed is not checked for it.
RESUME_SETTINGS = ("model", "input_shape", "num_classes", "dataset", "batch_size", "seed",
                   "augment", "dropout", "epochs", "lr", "momentum", "weight_decay",
                   "nesterov", "schedule", "step_epochs", "milestones", "gamma",
                   "warmup_epochs", "batchnorm", "label_smoothing", "clip_grad_norm",
                   "accumulate", "no_wd_bn_bias", "precision")
# What evaluating a checkpoint (--eval-only) needs of it: the same model, computing in the
# same precision (unless --allow-precision-change).
EVAL_SETTINGS = ("model", "input_shape", "num_classes", "dropout", "precision")
_SETTING_FLAGS = {"input_shape": "--variant"}


@dataclasses.dataclass
class Position:
    """Where a run is: the epoch, the steps of it done, the steps done in all."""
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


@dataclasses.dataclass
class Run:
    """The parts of a training run a checkpoint holds."""
    cfg: object
    model: object
    num_classes: int
    optimizer: object
    schedule: object      # None for a constant learning rate
    position: Position
    classes: list = None  # the class names of an image folder or packed set
    kernels: dict = None  # {layer: convolution algorithm (maybe "/fp32") or Linear.plan}

    def settings(self):
        """RESUME_SETTINGS of this run, as a checkpoint stores them."""
        values = {key: getattr(self.cfg, key, None) for key in RESUME_SETTINGS}
        values.update(input_shape=list(self.model.input_shape), num_classes=self.num_classes,
                      milestones=list(self.cfg.milestones))
        if self.classes is not None:
            values["classes"] = list(self.classes)
        if not self.model.batch_norm_layers():
            values["batchnorm"] = None          # the setting means nothing without BatchNorm
        return values

    def state(self):
        """The checkpoint's content."""
        return {
            "format": FORMAT,
            "config": dict(self.settings(), variant=self.cfg.variant),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict() if self.schedule else None,
            "generator": self.model.generator.bit_generator.state,
            "epoch": self.position.epoch, "step_in_epoch": self.position.step_in_epoch,
            "global_step": self.position.global_step,
            "kernels": self.kernels,
        }

    def restore(self, state, path, evaluate_only=False):
        """Continue from `state`, the checkpoint loaded from `path`, refusing one saved with
        other RESUME_SETTINGS, naming the flag; evaluate_only takes its model and its layers'
        kernel choices, refusing another model or precision only (EVAL_SETTINGS)."""
        if state.get("format") != FORMAT:
            raise checkpoint.CheckpointError(f"{path}: not a dynar training checkpoint")
        saved = state["config"]
        # An image folder's classes name the outputs: checked either way.
        checked = (EVAL_SETTINGS if evaluate_only else RESUME_SETTINGS) + ("classes",)
        if getattr(self.cfg, "allow_precision_change", False):
            checked = tuple(k for k in checked if k != "precision")
        mine = {k: v for k, v in self.settings().items() if k in checked}
        if "input_shape" not in saved:      # saved before the shape was: compare the flag
            mine = dict(mine, variant=self.cfg.variant)
        for key in mine:
            if key == "classes" and key in saved and saved[key] != mine[key]:
                differ = sorted(set(saved[key]) ^ set(mine[key]))
                raise checkpoint.CheckpointError(
                    f"{path}: saved with {len(saved[key])} other classes than this run's "
                    f"{len(mine[key])} (e.g. {differ[:3] or 'the same names in another order'}; "
                    f"--data-dir must hold the same classes)")
            if key in saved and saved[key] != mine[key]:
                flag = _SETTING_FLAGS.get(key, "--" + key.replace("_", "-"))
                hint = "give it the same settings"
                if key == "precision":
                    # A bf16 request on a CPU without bf16 instructions runs (and is) fp32.
                    where = (" (on a CPU with bf16 instructions, or with "
                             f"{precision.ANY_CPU_VARIABLE}=1)" if saved[key] == "bf16" else "")
                    hint = f"give it the same --precision{where} or pass --allow-precision-change"
                what = ("evaluating computes as that run did" if evaluate_only
                        else "resuming continues that run")
                raise checkpoint.CheckpointError(
                    f"{path}: saved with {flag} {saved[key]!r}, this run has {mine[key]!r} "
                    f"({what}: {hint})")
        self.model.load_state_dict(state["model"])
        # The algorithms it ran, so that it continues bit for bit on any machine.
        self.kernels = state.get("kernels")
        if evaluate_only:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.schedule is not None and state["schedule"] is not None:
            self.schedule.load_state_dict(state["schedule"])
        self.model.generator.bit_generator.state = state["generator"]
        self.position = Position(state["epoch"], state["step_in_epoch"], state["global_step"])


def resume_path(path):
    """The checkpoint `--resume PATH` names: the file, or a folder's last.ckpt."""
    return os.path.join(path, "last.ckpt") if os.path.isdir(path) else path


def require_writable(folder, flag):
    """Create `folder` if needed and write a file in it: an output that cannot be written is
    an error before the training, not after it."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write in {folder} ({exc.strerror or exc})") from None
