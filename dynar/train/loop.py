"""The training loop: data -> forward -> loss -> backward (gradient sync overlapped) -> update,
with held-out evaluation, checkpoints that resume bit for bit, and a JSON log.

One code path serves one process and an MPI job: `--batch-size` is the global batch, each
rank trains on its shard, and gradients are averaged over ranks before every update, so the
rank count never changes the math (up to float summation order).
"""
import dataclasses
import os
import tempfile
import time

import numpy as np

from .. import checkpoint, data, kernels, models, nn, optim
from ..dist.job import Job
from .report import Reporter

SCHEDULES = ("constant", "step", "multistep", "cosine")
CHECKPOINT_FORMAT = "dynar-train-v1"


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
    resume: str = None
    eval_every: int = 1
    sync: str = "dynamic"
    bucket_mb: float = 25.0
    compress: str = None
    trace: str = None


# Hyper-parameters that train each family well (batch is the global batch).
_FAMILY_DEFAULTS = {
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
    defaults = dict(_FAMILY_DEFAULTS[family(cfg.model)])
    if cfg.variant == "imagenet":
        defaults["dataset"] = "synthetic"  # no ImageNet reader: throughput runs only
    filled = {k: (defaults[k] if getattr(cfg, k) is None and k in defaults else getattr(cfg, k))
              for k in (f.name for f in dataclasses.fields(cfg))}
    cfg = TrainConfig(**filled)
    if cfg.augment is None:
        cfg.augment = cfg.dataset == "cifar10"
    return cfg


def _build_model(cfg, num_classes):
    kwargs = dict(num_classes=num_classes, seed=cfg.seed)
    if cfg.variant is not None:
        kwargs["variant"] = cfg.variant
    if cfg.dropout is not None:
        kwargs["dropout"] = cfg.dropout
    try:
        return models.get(cfg.model, **kwargs)
    except TypeError:
        raise ValueError(f"--dropout: model {cfg.model} has no dropout setting") from None


def _build_data(cfg):
    """(model, dataset, classes): the dataset decides the class count, except synthetic
    data, which takes the model's input shape."""
    if cfg.dataset == "synthetic":
        classes = cfg.num_classes or 10
        model = _build_model(cfg, classes)
        ds = data.load("synthetic", seed=cfg.seed, model_input_shape=model.input_shape,
                       num_classes=classes)
    else:
        ds = data.load(cfg.dataset, data_dir=cfg.data_dir, seed=cfg.seed,
                       num_classes=cfg.num_classes)
        classes = cfg.num_classes or ds.num_classes
        model = _build_model(cfg, classes)
        if tuple(ds.input_shape) != tuple(model.input_shape):
            shape = "x".join(map(str, model.input_shape))
            raise data.DataError(f"model {cfg.model} ({cfg.variant or 'default'} variant) takes "
                                 f"{shape} inputs but {ds.name} has "
                                 f"{'x'.join(map(str, ds.input_shape))} images")
    return model, ds, classes


def _build_schedule(cfg, opt, steps_per_epoch):
    """A per-iteration schedule (None for constant), epochs converted to steps."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule: unknown {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    total = cfg.epochs * steps_per_epoch
    if cfg.schedule == "step":
        sched = optim.StepLR(opt, cfg.step_epochs * steps_per_epoch, cfg.gamma)
    elif cfg.schedule == "multistep":
        sched = optim.MultiStepLR(opt, [m * steps_per_epoch for m in cfg.milestones], cfg.gamma)
    elif cfg.schedule == "cosine":
        sched = optim.CosineAnnealingLR(opt, total)
    else:
        sched = None
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    if warmup > 0:
        if sched is None:
            sched = optim.StepLR(opt, total + 1, 1.0)   # constant, wrapped by the warm-up
        sched = optim.LinearWarmup(sched, warmup)
    return sched


def _fingerprint(cfg, model, loader, sync):
    """Everything ranks must share to train one model together."""
    return {
        "model": [cfg.model, cfg.variant, list(model.input_shape)],
        "parameters": [[name, list(p.shape)] for name, p in model.named_parameters()],
        "sync": sync.describe() if sync else None,
        "trace": cfg.trace is not None,
        "batch split": [cfg.batch_size, loader.batch_size // loader.world, loader.steps],
        "data": [cfg.dataset, cfg.seed, cfg.augment],
        "optimizer": [cfg.lr, cfg.momentum, cfg.weight_decay, cfg.nesterov, cfg.schedule,
                      cfg.warmup_epochs, cfg.epochs, cfg.max_steps],
    }


# What a resumed run must share with the saved one to continue it: the model, the data and
# its order, and every hyper-parameter of the optimizer and its schedule. --max-steps,
# logging, threads and sync may differ.
_RESUME_SETTINGS = ("model", "input_shape", "num_classes", "dataset", "batch_size", "seed",
                    "augment", "dropout", "epochs", "lr", "momentum", "weight_decay",
                    "nesterov", "schedule", "step_epochs", "milestones", "gamma",
                    "warmup_epochs")
_SETTING_FLAGS = {"input_shape": "--variant"}


def _injected_fault(job, global_step):
    """Test-only switch: DYNAR_FAULT_STEP=k (and DYNAR_FAULT_RANK=r, default 0) makes rank r
    raise at global step k, to check that one failing rank ends the whole job."""
    step = os.environ.get("DYNAR_FAULT_STEP")
    if step is not None and global_step == int(step) \
            and job.rank == int(os.environ.get("DYNAR_FAULT_RANK", "0")):
        raise RuntimeError(f"injected fault at step {global_step} (DYNAR_FAULT_STEP)")


def _writable_folder(folder, flag):
    """Create `folder` if needed and write a file in it: an output that cannot be written is
    an error before the training, not after it."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write in {folder} ({exc.strerror or exc})") from None


class _Run:
    def __init__(self, cfg, job):
        self.cfg, self.job = cfg, job
        if job.rank == 0:       # the rank that writes checkpoints and the trace
            if cfg.checkpoint_dir is not None:
                _writable_folder(cfg.checkpoint_dir, "--checkpoint-dir")
            if cfg.trace is not None:
                _writable_folder(os.path.dirname(os.path.abspath(cfg.trace)), "--trace")
        threads = cfg.threads or (job.default_threads() if job.comm is not None
                                  else kernels.threads.default_num_threads())
        kernels.set_num_threads(threads)
        kernels.set_flush_denormals(True)
        self.threads = threads
        self.model, self.ds, self.num_classes = _build_data(cfg)
        self.loader = data.Loader(self.ds, cfg.batch_size, job.rank, job.world,
                                  augment=cfg.augment, seed=cfg.seed)
        self.test_loader = data.Loader(self.ds, cfg.batch_size, job.rank, job.world,
                                       split="test") if len(self.ds.y_test) else None
        self.criterion = nn.CrossEntropyLoss()
        self.node = None
        placement = {}
        if job.distributed:
            from ..dist import node_replica
            if node_replica.wanted(job.comm, self.model.flat_params.size, cfg.compress):
                self.node = node_replica.NodeReplica(self.model, job.comm)
                placement = dict(momentum_storage=self.node.momentum)
        self.opt = optim.SGD(self.model, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, **placement)
        self.sched = _build_schedule(cfg, self.opt, self.loader.steps)
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        if cfg.resume:
            self._resume(cfg.resume)
        total = cfg.epochs * self.loader.steps
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.report = Reporter(cfg.log, enabled=job.rank == 0, total_steps=self.total_steps,
                               steps_per_epoch=self.loader.steps, global_batch=cfg.batch_size)
        self.sync = None
        if job.distributed:
            from ..dist.sync import GradientSynchronizer
            self.sync = GradientSynchronizer(self.model, job.comm, cfg.sync, cfg.bucket_mb,
                                             cfg.compress, threads, self.report.event,
                                             node=self.node)
        job.agree(_fingerprint(cfg, self.model, self.loader, self.sync))
        self.tracer = None
        if cfg.trace:
            from ..dist.trace import Tracer
            self.tracer = Tracer(job.comm if job.distributed else None)
            if self.sync is not None:
                self.sync.tracer = self.tracer
        # Replicas start identical: rank 0's parameters and buffers everywhere.
        if self.node is not None:
            self.node.broadcast_parameters()
        else:
            job.broadcast(self.model.flat_params)
        self._sync_buffers()

    # -- state ------------------------------------------------------------------------------

    def _sync_buffers(self):
        """BatchNorm running statistics follow rank 0's (as DDP's broadcast_buffers)."""
        if self.job.distributed:
            for _, buf in self.model.named_buffers():
                self.job.broadcast(buf)

    def _settings(self):
        """_RESUME_SETTINGS of this run, as a checkpoint stores them."""
        values = {key: getattr(self.cfg, key, None) for key in _RESUME_SETTINGS}
        values.update(input_shape=list(self.model.input_shape), num_classes=self.num_classes,
                      milestones=list(self.cfg.milestones))
        return values

    def _state(self):
        cfg = self.cfg
        return {
            "format": CHECKPOINT_FORMAT,
            "config": dict(self._settings(), variant=cfg.variant),
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": self.sched.state_dict() if self.sched else None,
            "generator": self.model.generator.bit_generator.state,
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
        }

    def _resume(self, path):
        if os.path.isdir(path):
            path = os.path.join(path, "last.ckpt")
        state = checkpoint.load(path)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise checkpoint.CheckpointError(f"{path}: not a dynar training checkpoint")
        saved, mine = state["config"], self._settings()
        if "input_shape" not in saved:      # saved before the shape was: compare the flag
            mine = dict(mine, variant=self.cfg.variant)
        for key in mine:
            if key in saved and saved[key] != mine[key]:
                flag = _SETTING_FLAGS.get(key, "--" + key.replace("_", "-"))
                raise checkpoint.CheckpointError(
                    f"{path}: saved with {flag} {saved[key]!r}, this run has {mine[key]!r} "
                    f"(resuming continues that run: give it the same settings)")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.sched is not None and state["schedule"] is not None:
            self.sched.load_state_dict(state["schedule"])
        self.model.generator.bit_generator.state = state["generator"]
        self.epoch = state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        self.global_step = state["global_step"]

    def save(self, name):
        if self.cfg.checkpoint_dir is None:
            return
        self._sync_buffers()
        if self.job.rank == 0:
            path = os.path.join(self.cfg.checkpoint_dir, name)
            checkpoint.save(path, self._state())
            checkpoint.link_as_last(path)

    # -- steps ------------------------------------------------------------------------------

    def train_step(self, x, y):
        t0 = time.perf_counter()
        model = self.model
        model.zero_grad()
        logits = model.forward(x)
        loss = self.criterion.forward(logits, y)
        tb = time.perf_counter()
        model.backward(self.criterion.backward())
        t1 = time.perf_counter()
        exposed = self.sync.finish() if self.sync else 0.0
        t2 = time.perf_counter()
        if self.node is None:
            self.opt.step()
        else:
            self.opt.step(self.node.take_averaged())   # this rank's parts of every bucket
            self.node.barrier()   # every part updated before any rank reads the parameters
        if self.sched is not None:
            self.sched.step()
        t3 = time.perf_counter()
        if self.tracer is not None:
            for name, start, stop in (("forward", t0, tb), ("backward", tb, t1),
                                      ("update", t2, t3)):
                self.tracer.span(name, start, stop, step=self.global_step)
        return loss, {"compute": t1 - t0, "comm_exposed": exposed, "update": t3 - t2}

    def evaluate(self):
        """Held-out mean loss and accuracy over the whole test split (all ranks' shards)."""
        if self.test_loader is None:
            return None
        self._sync_buffers()
        self.model.eval()
        totals = np.zeros(3)   # loss sum, correct, count
        for x, y in self.test_loader.batches(0):
            if len(y) == 0:
                continue
            logits = self.model.forward(x)
            totals += (self.criterion.forward(logits, y) * len(y),
                       np.count_nonzero(logits.argmax(axis=1) == y), len(y))
        self.model.train()
        loss, correct, count = self.job.sum(totals)
        return {"loss": loss / count, "accuracy": correct / count}

    def train_epoch(self):
        """Steps of the current epoch from step_in_epoch on (a resumed run skips the batches
        it already trained on), stopping early at the run's last step. Returns the losses."""
        losses = []
        t_prev = time.perf_counter()
        for k, (x, y) in enumerate(self.loader.batches(self.epoch)):
            if k < self.step_in_epoch:
                t_prev = time.perf_counter()
                continue
            t_data = time.perf_counter() - t_prev
            _injected_fault(self.job, self.global_step)
            lr = self.opt.lr                    # the step's own: the schedule moves it after
            loss, timing = self.train_step(x, y)
            self.global_step += 1
            self.step_in_epoch = k + 1
            losses.append(loss)
            t_now = time.perf_counter()
            timing.update(data=t_data, step=t_now - t_prev)
            t_prev = t_now
            self.report.step(self.epoch, self.global_step, loss, lr, timing)
            if self.global_step >= self.total_steps:
                break
        return losses

    def run(self):
        cfg, report = self.cfg, self.report
        report.message(f"training {cfg.model} on {self.ds.name}"
                       + (" (synthetic data)" if self.ds.synthetic else "")
                       + f": {len(self.ds.y_train)} images, global batch {cfg.batch_size}, "
                       f"{self.job.world} rank(s) x {self.threads} thread(s), "
                       f"{self.loader.steps} steps/epoch")
        result = None
        while self.epoch < cfg.epochs and self.global_step < self.total_steps:
            losses = self.train_epoch()
            if self.step_in_epoch < self.loader.steps:     # --max-steps ended it mid-epoch
                self.save(f"step_{self.global_step:07d}.ckpt")
                break
            last = self.epoch + 1 == cfg.epochs or self.global_step >= self.total_steps
            evaluate = cfg.eval_every > 0 and ((self.epoch + 1) % cfg.eval_every == 0 or last)
            result = self.evaluate() if evaluate else None
            report.epoch(self.epoch, float(np.mean(losses)) if losses else float("nan"), result)
            self.epoch += 1
            self.step_in_epoch = 0
            self.save(f"epoch_{self.epoch:04d}.ckpt")
        if result is None and cfg.eval_every > 0:
            result = self.evaluate()
            if result is not None:
                report.message(f"held-out loss {result['loss']:.4f}, "
                               f"accuracy {100 * result['accuracy']:.2f}%")
        summary = report.summary(
            model=cfg.model, variant=cfg.variant, dataset=self.ds.name,
            synthetic=bool(self.ds.synthetic), batch_size=cfg.batch_size,
            threads=self.threads, ranks=self.job.world, sync=cfg.sync if self.sync else None,
            node_replica=None if self.node is None else self.node.describe(),
            compress=cfg.compress if self.sync else None,
            steps=self.global_step, epochs=self.epoch,
            final_accuracy=None if result is None else result["accuracy"],
            final_loss=None if result is None else result["loss"],
            param_checksum=float(np.sum(self.model.flat_params, dtype=np.float64)))
        report.close()
        if self.tracer is not None:
            self.tracer.write(cfg.trace)
        if self.sync is not None:
            self.sync.close()
        if self.node is not None:
            self.node.close()
        return summary


@dataclasses.dataclass
class TrainResult:
    summary: dict      # the log's summary record (rank 0; None on the other ranks)
    model: object      # this rank's trained model


def train(cfg, job=None):
    """Train as `cfg` says (unset fields take the model family's defaults)."""
    run = _Run(with_defaults(cfg), job or Job.start())
    return TrainResult(run.run(), run.model)
