"""Stopping on request: what SIGTERM, SIGUSR1 and SIGINT do to a training run of one process
(under mpiexec: tests/test_faults.py)."""
import os
import signal
import subprocess
import sys

import pytest

from dynar.train.preemption import REQUEUE_EXIT, StopRequests, exit_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--model", "lenet", "--dataset", "synthetic", "--batch-size", "16", "--threads", "1",
       "--eval-every", "0", "--max-steps", "40"]


def test_a_signal_is_recorded_and_a_second_one_acts_at_once():
    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stops:
        os.kill(os.getpid(), signal.SIGUSR1)       # Slurm's early warning
        assert stops.signal == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)       # then its time limit: still stopping
        assert stops.signal == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)    # Ctrl-C on top: stop at once
    assert signal.getsignal(signal.SIGINT) is before


def test_exit_statuses():
    assert exit_status(0, False) == 0
    assert exit_status(signal.SIGTERM, True) == REQUEUE_EXIT == 75
    assert exit_status(signal.SIGTERM, False) == 128 + 15


@pytest.mark.parametrize("fault, name", [("term", "SIGTERM"), ("usr1", "SIGUSR1"),
                                         ("int", "SIGINT")])
def test_each_signal_stops_after_the_step_with_a_checkpoint(tmp_path, fault, name):
    done = subprocess.run([sys.executable, "tests/mpi/failing_rank.py", "0", "7", fault, *RUN,
                           "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == REQUEUE_EXIT, done.stderr
    assert f"dynar: {name}: stopping after this step" in done.stderr
    assert f"stopped by {name} after step 7: checkpoint {tmp_path / 'step_0000007.ckpt'}" \
        in done.stdout


def test_without_a_checkpoint_dir_the_status_is_the_signal_s():
    done = subprocess.run([sys.executable, "tests/mpi/failing_rank.py", "0", "3", "term", *RUN],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "stopped by SIGTERM after step 3" in done.stdout
