"""The training loop: data -> forward -> loss -> backward (gradient sync overlapped) -> update,
with held-out evaluation, checkpoints that resume bit for bit, and a JSON log.

One code path serves one process and an MPI job: `--batch-size` is the global batch, each
rank trains on its shard, and gradients are averaged over ranks before every update
(dist/data_parallel.py), so the rank count never changes the math (up to float summation
order; BatchNorm too, with its statistics over the global batch). With --accumulate N each
rank's shard runs as N micro-batches whose gradients are averaged once, on the last. Each step
ends with a decision all ranks share: a stop request (a signal, see preemption.py) ends the
run after that step with a checkpoint; a non-finite loss or gradient raises or, with
--skip-nonfinite, skips the update.
"""
import contextlib
import dataclasses
import time

import numpy as np

from .. import kernels, nn
from ..dist.data_parallel import DataParallel, SyncConfig
from ..dist.job import Job
from ..dist.trace import Tracer
from ..nn import precision
from . import checkpoint_dir, preemption, state
from .build import (build_model_and_data, build_optimizer, build_schedule, choose_kernels,
                    output_folder, settings_ranks_share, start_from, what_ranks_built)
from .config import check_settings, with_defaults
from .metrics import held_out
from .report import Reporter, held_out_line, start_line
from .run_data import RunData


class Trainer:
    """One training run as `cfg` (defaults filled in) says, on this rank of `job`; `stops`
    (preemption.StopRequests) says when a signal asked it to stop."""

    def __init__(self, cfg, job, stops=None):
        self.cfg, self.job, self.stops = cfg, job, stops or preemption.StopRequests()
        check_settings(cfg, job.world)
        self.folder = output_folder(cfg, job)   # rank 0's CheckpointDir, or None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        cfg, job = self.cfg, self.job
        job.agree(settings_ranks_share(cfg))
        self.threads, self.threads_from = ((cfg.threads, "--threads") if cfg.threads
                                           else job.default_threads())
        kernels.set_num_threads(self.threads)
        kernels.set_flush_denormals(True)
        self.model, ds, self.num_classes = build_model_and_data(cfg, job)
        # Rank 0's CPU decides, so that every rank computes alike (the bf16 path runs on
        # any CPU); cfg then says what runs, for the log and the checkpoint.
        ran, self.precision_note = job.from_rank0(lambda: precision.resolve(cfg.precision))
        self.cfg = cfg = dataclasses.replace(cfg, precision=ran)
        precision.set_precision(self.model, ran)
        self.data = RunData(cfg, ds, job, self.threads)
        self.criterion = nn.CrossEntropyLoss(cfg.label_smoothing)
        self.held_out_loss = nn.CrossEntropyLoss()     # the metric, whatever the recipe
        self.opt = build_optimizer(cfg, self.model)
        self.sched = build_schedule(cfg, self.opt, self.data.train.steps)
        self.run_state = state.Run(cfg, self.model, self.num_classes, self.opt, self.sched,
                                   state.Position(), getattr(ds, "classes", None))
        start_from(cfg, job, self.folder, self.run_state)
        self.kernels = choose_kernels(cfg, job, self.data, self.run_state, self.threads)
        total = cfg.epochs * self.data.train.steps
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.report = Reporter(cfg.log, enabled=job.rank == 0, total_steps=self.total_steps,
                               steps_per_epoch=self.data.train.steps,
                               global_batch=cfg.batch_size, log_every=cfg.log_every)
        self.tracer = Tracer(job.comm if job.distributed else None) if cfg.trace else None
        self.dp = DataParallel(
            self.model, self.opt, job,
            SyncConfig(cfg.sync, cfg.bucket_mb, cfg.compress, batchnorm=cfg.batchnorm),
            threads=self.threads, on_event=self.report.event, tracer=self.tracer,
            on_nonfinite="skip" if cfg.skip_nonfinite else "raise",
            first_step=self.position.global_step, stall_timeout=cfg.stall_timeout,
            agree=what_ranks_built(self.model, self.data, self.position))
        self.stopped_by, self.checkpoint, self.skipped = 0, None, 0

    @property
    def position(self):
        return self.run_state.position

    def save(self, kind):
        """Collective: the checkpoint of this point, named by its epoch or its step (`kind`);
        an error is raised on every rank alike."""
        if self.cfg.checkpoint_dir is None:
            return None
        self.dp.broadcast_buffers()
        self.checkpoint = checkpoint_dir.save_across_ranks(self.job, self.folder,
                                                           self.run_state, kind)
        return self.checkpoint

    # -- steps ------------------------------------------------------------------------------

    def train_step(self, x, y):
        """One step on this rank's shard (x, y): its micro-batches' forward and backward,
        every one but the last without gradient sync, then clipping and the update."""
        t0 = time.perf_counter()
        model, micro = self.model, self.cfg.accumulate
        model.zero_grad(lazy=True)
        size, loss, spans = len(y) // micro, 0.0, []
        for k in range(micro):
            part = slice(k * size, (k + 1) * size)
            with self.dp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                tf = time.perf_counter()
                logits = model.forward(x[part])
                # The step's loss is the mean of the micro-batches', as the whole shard's.
                loss += self.criterion.forward(logits, y[part]) / micro
                tb = time.perf_counter()
                model.backward(self.criterion.backward(1.0 / micro))
                spans += [("forward", tf, tb), ("backward", tb, time.perf_counter())]
        t1 = time.perf_counter()
        timing = {"compute": t1 - t0}
        if self.cfg.clip_grad_norm is not None:
            timing["grad_norm"] = self.dp.clip_grad_norm_(self.cfg.clip_grad_norm)
        outcome = self.dp.step(loss, stop=self.stops.signal)
        if self.sched is not None:
            self.sched.step()
        t3 = time.perf_counter()
        if self.tracer is not None:
            for name, start, stop in spans + [("update", t3 - outcome.update, t3)]:
                self.tracer.span(name, start, stop, step=self.position.global_step)
        timing.update(comm_exposed=outcome.comm_exposed, update=outcome.update,
                      batch_stats=outcome.batch_stats)
        return loss, outcome, timing

    def evaluate(self):
        """Held-out loss, top-1 and top-5 over the whole test split (metrics.held_out)."""
        if self.data.held_out is None:
            return None
        self.dp.broadcast_buffers()
        return held_out(self.model, self.data.held_out, self.held_out_loss, self.job.sum,
                        self.num_classes)

    def train_epoch(self):
        """Steps of the current epoch from step_in_epoch on (a resumed run skips the batches
        it already trained on), stopping early at the run's last step or on a stop request.
        Returns the losses."""
        at, every = self.position, self.cfg.checkpoint_every
        losses = []
        t_prev = time.perf_counter()
        batches = self.data.train.batches(at.epoch, start=at.step_in_epoch)
        for k, (x, y) in enumerate(batches, start=at.step_in_epoch):
            t_data = time.perf_counter() - t_prev
            lr = self.opt.lr                    # the step's own: the schedule moves it after
            loss, outcome, timing = self.train_step(x, y)
            at.global_step += 1
            at.step_in_epoch = k + 1
            self.skipped += outcome.skipped
            if not outcome.skipped:
                losses.append(loss)
            t_now = time.perf_counter()
            grad_norm = timing.pop("grad_norm", None)
            timing.update(data=t_data, step=t_now - t_prev)
            t_prev = t_now
            self.report.step(at.epoch, at.global_step, loss, lr, timing, outcome.skipped,
                             grad_norm)
            if outcome.stop:
                self.stopped_by = outcome.stop
                break
            if at.global_step >= self.total_steps:
                break
            if every and at.global_step % every == 0 and k + 1 < self.data.train.steps:
                self.save("step")
        batches.close()     # stops the prefetch of an epoch left early
        return losses

    def _summary(self, result, **fields):
        """The log's closing record: what ran, how it was spread, what it reached."""
        cfg, parallel, ds = self.cfg, self.dp.describe(), self.data.ds
        reached = {f"final_{k}": None if result is None else result[k]
                   for k in ("accuracy", "top5", "loss")}
        return self.report.summary(
            model=cfg.model, variant=cfg.variant, dataset=ds.name, synthetic=bool(ds.synthetic),
            batch_size=cfg.batch_size, threads=self.threads, threads_from=self.threads_from,
            ranks=self.job.world, sync=parallel["sync"], node_replica=parallel["node replica"],
            compress=parallel["compress"],
            data_workers=self.data.workers if self.data.images else None,
            batchnorm=cfg.batchnorm if self.model.batch_norm_layers() else None,
            precision=cfg.precision, **reached,
            param_checksum=float(np.sum(self.model.flat_params, dtype=np.float64)), **fields)

    def run_eval_only(self):
        """--eval-only: the held-out figures of the weights given, nothing trained or
        written; returns the summary record (rank 0)."""
        cfg = self.cfg
        self.report.message(f"evaluating {cfg.model} from {cfg.init_from or cfg.resume} on "
                            f"{self.data.ds.name}: {len(self.data.ds.y_test)} held-out images, "
                            f"{self.job.world} rank(s) x {self.threads} thread(s)")
        result = self.evaluate()
        self.report.message(held_out_line(result))
        summary = self._summary(result, steps=0, epochs=0, eval_only=True)
        self.report.close()
        return summary

    def run(self):
        """Train to the end (cfg.epochs, or --max-steps) or to a stop request; returns the
        log's summary record (rank 0; None on the other ranks)."""
        cfg, report, at = self.cfg, self.report, self.position
        report.config(dataclasses.asdict(cfg))
        if self.precision_note:
            report.message(self.precision_note)
        if cfg.eval_only:
            report.kernels(self.kernels)
            return self.run_eval_only()
        report.message(start_line(cfg, self.data, self.job.world, self.threads,
                                  self.threads_from, bool(self.model.batch_norm_layers())))
        report.kernels(self.kernels)
        self.data.announce(report)
        result = None
        while at.epoch < cfg.epochs and at.global_step < self.total_steps:
            losses = self.train_epoch()
            if self.stopped_by or at.step_in_epoch < self.data.train.steps:
                self.save("step")          # a stop request or --max-steps ended it mid-epoch
                break
            last = at.epoch + 1 == cfg.epochs or at.global_step >= self.total_steps
            evaluate = cfg.eval_every > 0 and ((at.epoch + 1) % cfg.eval_every == 0 or last)
            result = self.evaluate() if evaluate else None
            self.data.count_bad_images(report, at.epoch + 1)
            report.epoch(at.epoch, float(np.mean(losses)) if losses else None, result)
            at.epoch += 1
            at.step_in_epoch = 0
            self.save("epoch")
        if self.stopped_by:
            report.stopped(preemption.name(self.stopped_by), at.global_step, self.checkpoint)
        elif result is None and cfg.eval_every > 0:
            result = self.evaluate()
            if result is not None:
                report.message(held_out_line(result))
        summary = self._summary(result, steps=at.global_step, epochs=at.epoch,
                                skipped_steps=self.skipped,
                                stopped_by=preemption.name(self.stopped_by)
                                if self.stopped_by else None)
        report.close()
        self.data.close()
        if self.tracer is not None:
            self.tracer.write(cfg.trace)
        return summary

    def close(self):
        if self.folder is not None:
            self.folder.close()


@dataclasses.dataclass
class TrainResult:
    summary: dict      # the log's summary record (rank 0; None on the other ranks)
    model: object      # this rank's trained model
    stopped_by: int = 0        # the signal that stopped the run early, or 0
    checkpoint: str = None     # the last checkpoint written (rank 0's path; None if none)


def train(cfg, job=None):
    """Train as `cfg` (a TrainConfig) says; unset fields take the model family's defaults.
    SIGTERM, SIGUSR1 and SIGINT stop it after the current step (preemption.py). The
    kernels' thread count and flush-denormals mode are as before when it returns."""
    cfg, job = with_defaults(cfg), job or Job.start()
    with preemption.StopRequests() as stops, kernels.settings_kept():
        trainer = Trainer(cfg, job, stops)
        try:
            with trainer.dp:
                summary = trainer.run()
        finally:
            trainer.close()
    return TrainResult(summary, trainer.model, trainer.stopped_by, trainer.checkpoint)
