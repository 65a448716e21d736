"""Stopping on request: SIGTERM, SIGUSR1 and SIGINT end a training run at the next step
boundary instead of killing it mid-step.

Batch schedulers announce the end of a job with a signal (Slurm: SIGTERM at the time limit
or on `scancel`, whatever `--signal=USR1@120` or `scancel --signal` names ahead of it,
SIGTERM before `scontrol requeue`), users with Ctrl-C. The handler only records the
signal; the loop passes it to the step's decision (DataParallel.step(stop=...)), so every
rank stops after the same step even when only one was signalled, writes one checkpoint and
exits with REQUEUE_EXIT. A SIGINT after any of them, or a second SIGTERM, ends the process
at once.
"""
import os
import signal
import threading

# sysexits.h's EX_TEMPFAIL, "try again later": the run was stopped on request and left a
# checkpoint, so running the same command with --resume auto continues it. Distinct from a
# process killed by the signal before it could save (128 + the signal's number).
REQUEUE_EXIT = 75

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_status(signum, checkpointed):
    """The exit status of a run stopped by `signum` (0: a run that finished): REQUEUE_EXIT
    when it left a checkpoint to resume from, else the shell's 128 + signum."""
    if not signum:
        return 0
    return REQUEUE_EXIT if checkpointed else 128 + signum


def name(signum):
    return signal.Signals(signum).name


class StopRequests:
    """Within the `with` block, STOP_SIGNALS set `signal` (the first one's number) instead of
    their default action; the previous handlers come back on leaving it. Outside the main
    thread (where Python cannot take signals) nothing is installed and `signal` stays 0."""

    def __init__(self):
        self.signal = 0
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signal and (signum == signal.SIGINT or signum == self.signal == signal.SIGTERM):
            # Asked twice: the user (or the scheduler) will not wait for the step to end. (A
            # scheduler's SIGTERM after its early SIGUSR1 is no reason to lose the checkpoint.)
            self._restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
        if not self.signal:
            # os.write: a print() here could land inside another print() to stderr.
            again = " (again to stop at once)" if signum != signal.SIGUSR1 else ""
            os.write(2, f"dynar: {name(signum)}: stopping after this step{again}\n".encode())
        self.signal = self.signal or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _restore(self):
        for signum, handler in self._previous.items():
            # None: a handler not installed from Python, which is then the default's.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()
        return False
