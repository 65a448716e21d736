"""What a training run tells its user: a progress line, per-epoch results, a JSON log.

On a terminal the progress line redraws in place (step, img/s, loss, ETA); otherwise (a log
file, CI) a plain line is printed a few times per epoch. `--log FILE` gets one JSON object
per line: per step, per epoch, and a final summary whose throughput figures are medians over
the measured steps (the first WARMUP_STEPS excluded: they pay for buffer allocation).
"""
import json
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
                 steps_per_epoch=1, global_batch=1):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        # Open MPI gives ranks a pseudo-terminal even when mpiexec's output goes to a file,
        # so under a launcher the plain lines are used.
        self.live = enabled and self.stream.isatty() and not launched_by_mpiexec()
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.plain_every = max(1, steps_per_epoch // 4)
        self.log = open(log_path, "a", buffering=1) if enabled and log_path else None
        self.steps = []          # per-step timing records after warm-up
        self.epochs = []
        self._last_draw = 0.0
        self._start = time.perf_counter()
        self._seen_steps = 0

    def _write_json(self, obj):
        if self.log:
            self.log.write(json.dumps(obj) + "\n")

    def message(self, text):
        if self.enabled:
            if self.live:
                self.stream.write("\r\033[K")
            print(text, file=self.stream, flush=True)

    def step(self, epoch, step, loss, lr, timing):
        """timing: dict of seconds (step, data, compute, comm_exposed, update)."""
        if not self.enabled:
            return
        self._seen_steps += 1
        if self._seen_steps > WARMUP_STEPS:
            self.steps.append(timing)
        img_s = self.global_batch / timing["step"] if timing["step"] > 0 else 0.0
        self._write_json({"event": "step", "epoch": epoch, "step": step, "loss": loss, "lr": lr,
                          "images_per_sec": img_s, **{f"{k}_s": v for k, v in timing.items()}})
        now = time.perf_counter()
        recent = self.steps[-20:] if self.steps else [timing]
        rate = self.global_batch / statistics.median(t["step"] for t in recent)
        eta = ""
        if self.total_steps:
            left = self.total_steps - step
            eta = f"  ETA {_fmt_duration(left * self.global_batch / rate)}"
        line = (f"epoch {epoch + 1} step {step}" + (f"/{self.total_steps}" if self.total_steps else "")
                + f"  loss {loss:.4f}  {rate:,.0f} img/s{eta}")
        if self.live:
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
        text = f"epoch {epoch + 1}: train loss {train_loss:.4f}"
        if eval_result is not None:
            record.update(eval_loss=eval_result["loss"], eval_accuracy=eval_result["accuracy"])
            text += (f", held-out loss {eval_result['loss']:.4f}, "
                     f"accuracy {100 * eval_result['accuracy']:.2f}%")
        self.epochs.append(record)
        self._write_json(record)
        self.message(text)

    def event(self, record):
        if self.enabled:
            self._write_json(record)

    def summary(self, **fields):
        """The final record: medians of the measured steps plus `fields`."""
        if not self.enabled:
            return None
        steps = self.steps
        med = {k: statistics.median(t[k] for t in steps) if steps else None
               for k in ("step", "data", "compute", "comm_exposed", "update")}
        total_step = sum(t["step"] for t in steps)
        summary = {
            "event": "summary",
            "images_per_sec": self.global_batch / med["step"] if med["step"] else None,
            "step_time_s": med["step"], "data_time_s": med["data"],
            "compute_s": med["compute"], "comm_exposed_s": med["comm_exposed"],
            "update_time_s": med["update"],
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
