"""What a training run tells its user: a progress line, per-epoch results, a JSON log.

On a terminal the progress line redraws in place (step, img/s, loss, ETA); otherwise (a log
file, CI) a plain line is printed a few times per epoch, or every `log_every` steps
(--log-every, which on a terminal also leaves a line every so many steps). The effective
configuration is printed at the start. `--log FILE` gets one JSON object per line: the
configuration, per step, per epoch, and a final summary whose throughput figures are medians
over the measured steps (the first WARMUP_STEPS excluded: they pay for buffer allocation).
The log is strict JSON: a non-finite number (a diverged loss) is written as null.
"""
import json
import math
import statistics
import sys
import time

from ..dist.runtime import launched_by_mpiexec

WARMUP_STEPS = 3
REDRAW_SECONDS = 0.2


def _fmt_duration(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Reporter:
    """Only rank 0 reports; other ranks get a Reporter with enabled=False."""

    def __init__(self, log_path=None, enabled=True, stream=None, total_steps=None,
                 steps_per_epoch=1, global_batch=1, log_every=None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        # Open MPI gives ranks a pseudo-terminal even when mpiexec's output goes to a file,
        # so under a launcher the plain lines are used.
        self.live = enabled and self.stream.isatty() and not launched_by_mpiexec()
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.log_every = log_every
        self.plain_every = log_every or max(1, steps_per_epoch // 4)
        self.log_path = log_path
        self.log = open(log_path, "a", buffering=1) if enabled and log_path else None
        self.steps = []          # per-step timing records after warm-up
        self.epochs = []
        self._last_draw = 0.0
        self._start = time.perf_counter()
        self._seen_steps = 0

    def _write_json(self, obj):
        if self.log:
            try:
                self.log.write(json.dumps(_finite_or_null(obj), allow_nan=False) + "\n")
            except OSError as exc:
                raise OSError(exc.errno, f"cannot write the log {self.log_path}: "
                                         f"{exc.strerror or exc}") from None

    def message(self, text):
        if self.enabled:
            if self.live:
                self.stream.write("\r\033[K")
            print(text, file=self.stream, flush=True)

    def config(self, settings):
        """The run's effective settings (every flag, defaults filled in): one line and a
        JSON record."""
        if not self.enabled:
            return
        self._write_json({"event": "config", **settings})
        shown = " ".join(f"{k}={v}" for k, v in settings.items() if v is not None and v != ())
        self.message(f"settings: {shown}")

    def step(self, epoch, step, loss, lr, timing, skipped=False, grad_norm=None):
        """timing: dict of seconds (step, data, compute, comm_exposed, update, batch_stats);
        skipped: the update was skipped (a non-finite loss or gradient); grad_norm: the
        gradient's norm before clipping, when clipped."""
        if not self.enabled:
            return
        self._seen_steps += 1
        if self._seen_steps > WARMUP_STEPS:
            self.steps.append(timing)
        img_s = self.global_batch / timing["step"] if timing["step"] > 0 else 0.0
        record = {"event": "step", "epoch": epoch, "step": step, "loss": loss, "lr": lr,
                  "images_per_sec": img_s, **{f"{k}_s": v for k, v in timing.items()}}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if skipped:
            record["skipped"] = "non-finite loss or gradient"
        self._write_json(record)
        now = time.perf_counter()
        recent = self.steps[-20:] if self.steps else [timing]
        rate = self.global_batch / statistics.median(t["step"] for t in recent)
        eta = ""
        if self.total_steps:
            left = self.total_steps - step
            eta = f"  ETA {_fmt_duration(left * self.global_batch / rate)}"
        line = (f"epoch {epoch + 1} step {step}" + (f"/{self.total_steps}" if self.total_steps else "")
                + f"  loss {loss:.4f}  {rate:,.0f} img/s{eta}" + ("  (skipped)" if skipped else ""))
        if self.live and self.log_every and step % self.log_every == 0:
            self.stream.write("\r\033[K" + line + "\n")
            self.stream.flush()
        elif self.live:
            if now - self._last_draw >= REDRAW_SECONDS:
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
                self._last_draw = now
        elif step % self.plain_every == 0:
            print(line, file=self.stream, flush=True)

    def epoch(self, epoch, train_loss, eval_result):
        if not self.enabled:
            return
        record = {"event": "epoch", "epoch": epoch + 1, "train_loss": train_loss,
                  "elapsed_s": time.perf_counter() - self._start}
        text = f"epoch {epoch + 1}: train loss " + (
            "-" if train_loss is None else f"{train_loss:.4f}")
        if eval_result is not None:
            record.update(eval_loss=eval_result["loss"], eval_accuracy=eval_result["accuracy"],
                          eval_top5=eval_result["top5"])
            text += (f", held-out loss {eval_result['loss']:.4f}, "
                     f"accuracy {100 * eval_result['accuracy']:.2f}%")
            if eval_result["top5"] is not None:
                text += f" (top-5 {100 * eval_result['top5']:.2f}%)"
        self.epochs.append(record)
        self._write_json(record)
        self.message(text)

    def stopped(self, signal_name, step, checkpoint):
        """The run was stopped on request after `step`, leaving `checkpoint` (or None)."""
        self.message(f"stopped by {signal_name} after step {step}" + (
            f": checkpoint {checkpoint}; continue with --resume auto" if checkpoint else ""))

    def bad_images(self, epoch, total, rank0_files):
        """The epoch's unreadable images (--skip-bad-images): all ranks' count, and the names
        rank 0 met."""
        if total:
            self.event({"event": "bad_images", "epoch": epoch, "count": total,
                        "rank0_files": sorted(rank0_files)})
            self.message(f"skipped {total} unreadable image(s) this epoch, each replaced by "
                         f"the next of its class (--skip-bad-images)"
                         + (f"; first: {min(rank0_files)}" if rank0_files else ""))

    def kernels(self, records):
        """The convolutions' algorithms and the fully connected layers' plans
        (train/build.py's choose_kernels): one line, how many convolutions run on each
        algorithm and where the choices came from, and a log record of each."""
        if not self.enabled or not records:
            return
        def count(field, among):
            values = [r[field] for r in among]
            return ", ".join(f"{values.count(v)} {v}" for v in sorted(set(values)))
        convs = [r for r in records if r["kind"] == "conv"]
        linears = len(records) - len(convs)
        self.message(f"kernels: {len(convs)} convolutions on {count('choice', convs)}"
                     + (f", {linears} fully connected layers' cuts" if linears else "")
                     + f" ({count('source', records)})")
        self.event({"event": "kernels", "layers": records})

    def event(self, record):
        if self.enabled:
            self._write_json(record)

    def summary(self, **fields):
        """The final record: medians of the measured steps plus `fields`."""
        if not self.enabled:
            return None
        steps = self.steps
        med = {k: statistics.median(t[k] for t in steps) if steps else None
               for k in ("step", "data", "compute", "comm_exposed", "update", "batch_stats")}
        total_step = sum(t["step"] for t in steps)
        summary = {
            "event": "summary",
            "images_per_sec": self.global_batch / med["step"] if med["step"] else None,
            "step_time_s": med["step"], "data_time_s": med["data"],
            "compute_s": med["compute"], "comm_exposed_s": med["comm_exposed"],
            "update_time_s": med["update"], "batch_stats_s": med["batch_stats"],
            "data_time_fraction": sum(t["data"] for t in steps) / total_step if total_step else None,
            "measured_steps": len(steps), "elapsed_s": time.perf_counter() - self._start,
            **fields,
        }
        self._write_json(summary)
        if self.live:
            self.stream.write("\r\033[K")
        return summary

    def close(self):
        if self.log:
            self.log.close()
            self.log = None


def _finite_or_null(value):
    """`value` with every non-finite float (NaN, inf) replaced by None, in nested dicts and
    lists: json.dumps would write the bare NaN that strict JSON parsers refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def start_line(cfg, run_data, world, threads, threads_from, batch_norm):
    """The run's first line: what trains on what, and how it is spread."""
    ds, steps_per_epoch = run_data.ds, run_data.train.steps
    return (f"training {cfg.model} on {ds.name}" + (" (synthetic data)" if ds.synthetic else "")
            + f": {len(ds.y_train)} images, global batch {cfg.batch_size}"
            + (f" in {cfg.accumulate} micro-batches" if cfg.accumulate > 1 else "")
            + f", {world} rank(s) x {threads} thread(s) ({threads_from}), "
            f"{steps_per_epoch} steps/epoch"
            + (f", batchnorm {cfg.batchnorm}" if batch_norm else "")
            + (f", precision {cfg.precision}" if cfg.precision != "fp32" else ""))


def held_out_line(result):
    """The held-out figures as the closing line prints them."""
    top5 = "-" if result["top5"] is None else f"{100 * result['top5']:.2f}%"
    return (f"held-out loss {result['loss']:.4f}, top-1 {100 * result['accuracy']:.2f}%, "
            f"top-5 {top5} ({result['images']} images)")
