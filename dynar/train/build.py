"""What a TrainConfig builds: the model and its dataset, the optimizer and the learning-rate
schedule, the point the run starts from, the convolutions' algorithms, and what every rank
of a job must build alike."""
import os

from .. import data, models, optim, weights
from ..nn import kernel_tuning
from . import checkpoint_dir
from .checkpoint_dir import CheckpointDir
from .state import require_writable
from .config import SCHEDULES


def build_model(cfg, num_classes):
    kwargs = dict(num_classes=num_classes, seed=cfg.seed)
    if cfg.variant is not None:
        kwargs["variant"] = cfg.variant
    if cfg.dropout is not None:
        kwargs["dropout"] = cfg.dropout
    try:
        return models.get(cfg.model, **kwargs)
    except TypeError:
        raise ValueError(f"--dropout: model {cfg.model} has no dropout setting") from None


def build_model_and_data(cfg, job):
    """(model, dataset, classes): the dataset decides the class count, except synthetic
    data, which takes the model's input shape. An image folder is listed by rank 0 alone
    and the listing broadcast: a million files are not walked by every rank."""
    if cfg.dataset == "synthetic":
        classes = cfg.num_classes or 10
        model = build_model(cfg, classes)
        ds = data.load("synthetic", seed=cfg.seed, model_input_shape=model.input_shape,
                       num_classes=classes)
    else:
        def load():
            return data.load(cfg.dataset, data_dir=cfg.data_dir, seed=cfg.seed,
                             num_classes=cfg.num_classes)
        ds = job.from_rank0(load) if cfg.dataset == "imagefolder" else load()
        classes = cfg.num_classes or ds.num_classes
        model = build_model(cfg, classes)
        if isinstance(ds, data.ImageDataset):
            ds.resize_to(model.input_shape)
        elif tuple(ds.input_shape) != tuple(model.input_shape):
            shape = "x".join(map(str, model.input_shape))
            raise data.DataError(f"model {cfg.model} ({cfg.variant or 'default'} variant) takes "
                                 f"{shape} inputs but {ds.name} has "
                                 f"{'x'.join(map(str, ds.input_shape))} images")
    return model, ds, classes


def build_optimizer(cfg, model):
    """SGD as cfg says; with no_wd_bn_bias, BatchNorm parameters and every bias in a group
    of their own without weight decay (as the recipes that exempt them do)."""
    kwargs = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                  nesterov=cfg.nesterov)
    if not cfg.no_wd_bn_bias:
        return optim.SGD(model, **kwargs)
    norms = {id(p) for layer in model.batch_norm_layers() for p in layer.parameters()}
    exempt = {id(p) for name, p in model.named_parameters()
              if id(p) in norms or name.rsplit(".", 1)[-1] == "bias"}
    groups = [{"params": [p for p in model.parameters() if id(p) not in exempt]},
              {"params": [p for p in model.parameters() if id(p) in exempt],
               "weight_decay": 0.0}]
    return optim.SGD(groups, **kwargs)


def build_schedule(cfg, opt, steps_per_epoch):
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


def output_folder(cfg, job):
    """Rank 0's CheckpointDir (None elsewhere, or without --checkpoint-dir), once --trace's
    folder is found writable: both are checked before anything is built."""
    if job.rank != 0 or cfg.eval_only:
        return None
    if cfg.trace is not None:
        require_writable(os.path.dirname(os.path.abspath(cfg.trace)), "--trace")
    if cfg.checkpoint_dir is None:
        return None
    return CheckpointDir(cfg.checkpoint_dir, cfg.keep_last)


def start_from(cfg, job, folder, run_state):
    """Where the run starts: the checkpoint rank 0 finds (--resume), which every rank
    restores, else fresh weights, or --init-from's on rank 0 (DataParallel then gives every
    rank rank 0's)."""
    found = checkpoint_dir.resume_point(job, folder, cfg.resume)
    if found is not None:
        run_state.restore(found[1], found[0], evaluate_only=cfg.eval_only)
    if folder is not None:
        folder.start_at(run_state.position.global_step)
    if cfg.init_from and job.rank == 0:
        weights.load_weights(run_state.model, cfg.init_from, cfg.init_from_head == "new",
                             what=f"{cfg.model} ({cfg.variant or 'default'} variant, "
                                  f"{run_state.num_classes} classes)")


def choose_kernels(cfg, job, run_data, run_state, threads):
    """Each convolution's algorithm and fully connected layer's plan, set on the model: a
    resumed or evaluated run's from its checkpoint (it continues bit for bit; a held-out
    figure is the one its training reported, a bf16 run's float32 layers included), else
    timed on rank 0 (nn/kernel_tuning.py) at this rank's micro-batch and run alike by every
    rank; --eval-only from other weights times nothing (the thresholds). Returns the records
    the log gets, or None."""
    model = run_state.model
    if run_state.kernels:
        layers = dict(model.named_modules())
        records = [{"layer": layer, "kind": kernel_tuning.kind(layers[layer]),
                    "choice": choice, "source": "checkpoint"}
                   for layer, choice in run_state.kernels.items()]
    elif cfg.eval_only:
        return None
    else:
        batch = run_data.train.batch_size // job.world // cfg.accumulate
        records = job.from_rank0(lambda: kernel_tuning.choose(model, batch, threads))
        run_state.kernels = {r["layer"]: r["choice"] for r in records}
    kernel_tuning.apply(model, records)
    return records


def settings_ranks_share(cfg):
    """The start-up agreement's first part, from the command line alone: every setting that
    decides whether a collective runs (evaluation, checkpoints, the trace) and what is
    trained. Checked before anything is built, since building runs collectives of its own
    (an image folder's listing, the resume point, the kernels' timing) that ranks with other
    settings would not enter alike."""
    return {"model": [cfg.model, cfg.variant],
            "trace": cfg.trace is not None,
            "batch split": [cfg.batch_size, cfg.accumulate],
            "data": [cfg.dataset, cfg.seed, cfg.augment, cfg.skip_bad_images],
            "optimizer": [cfg.lr, cfg.momentum, cfg.weight_decay, cfg.nesterov, cfg.schedule,
                          cfg.warmup_epochs, cfg.epochs, cfg.max_steps, cfg.no_wd_bn_bias],
            "recipe": [cfg.label_smoothing, cfg.clip_grad_norm, cfg.eval_only, cfg.precision,
                       cfg.allow_precision_change],
            "evaluation": [cfg.eval_every],
            "checkpoints": [cfg.checkpoint_dir is not None, cfg.checkpoint_every]}


def what_ranks_built(model, run_data, position):
    """The agreement's second part (DataParallel's `agree`): what each rank built from those
    settings and its files (the model's input, the data's sizes and split, where the run
    starts)."""
    ds, loader = run_data.ds, run_data.train
    return {"model input": list(model.input_shape),
            "data size": [len(ds.y_train), len(ds.y_test), run_data.held_out is not None],
            "batch shares": [loader.batch_size // loader.world, loader.steps],
            "resumed at": [position.epoch, position.step_in_epoch, position.global_step]}
