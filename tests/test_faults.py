"""Faults, injected into real jobs: a rank killed mid-allreduce, one stopped or stuck, a
signal asking the job to stop, an error on the communication thread, a diverging run, a full
disk. Each must end every rank within seconds with one line saying what happened (and, for
a signal, a checkpoint and exit status 75); a job stopped and resumed any number of times
ends bitwise identical to one that never was."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dynar import checkpoint
from dynar.dist import runtime
from mpirun import ROOT, mpi_env, mpiexec
from support.runs import assert_bitwise_same_run

FAULTS = "tests/mpi/failing_rank.py"
# Small buckets, so that some go to the communication thread; one thread per rank.
LENET = ["--model", "lenet", "--dataset", "synthetic", "--batch-size", "16", "--threads", "1",
         "--eval-every", "0", "--sync", "buckets", "--bucket-mb", "0.05"]
REQUEUE = 75


def launch(ranks, args, mpiexec_args=(), timeout=60, marker=None):
    """Popen of `python args...` on `ranks` ranks (a plain process for 0)."""
    cmd = [sys.executable, *args]
    if ranks:
        cmd = [*mpiexec(), *mpiexec_args, "-n", str(ranks), *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env({"DYNAR_TEST_MARKER": marker or ""}), cwd=ROOT,
                            stdin=subprocess.DEVNULL)


def finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(ranks, args, mpiexec_args=(), timeout=60):
    start = time.monotonic()
    code, out, err = finish(launch(ranks, args, mpiexec_args), timeout)
    return code, out, err, time.monotonic() - start


def rank_pid(marker, rank, timeout=30):
    """The pid of the job's rank `rank` (found by its environment), once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            ranks = {env.get(b"OMPI_COMM_WORLD_RANK"), env.get(b"PMI_RANK")}
            if env.get(b"DYNAR_TEST_MARKER") == marker.encode() and str(rank).encode() in ranks:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of job {marker} never appeared")


def wait_for_steps(log, steps, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and log.read_text().count('"event": "step"') >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"{log} did not reach {steps} steps: {proc.poll()}")


def dynar_lines(err):
    return [line for line in err.splitlines() if "dynar" in line or "error:" in line]


# -- lost and stalled ranks -------------------------------------------------------------


def keep_survivors():
    """mpiexec's option to leave the other ranks running when one dies, as srun's default
    does: Open MPI's --enable-recovery, MPICH's -disable-auto-cleanup."""
    version = subprocess.run([mpiexec()[0], "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        return ["--enable-recovery"]
    if "HYDRA" in version:
        return ["-disable-auto-cleanup"]
    pytest.skip(f"no known option of this mpiexec keeps survivors running: {version[:60]!r}")


@pytest.mark.parametrize("launcher", ["mpiexec", "survivors left running"])
def test_a_rank_killed_mid_allreduce_ends_the_job(launcher):
    # With survivors left running only the watchdog can end them.
    extra = keep_survivors() if launcher != "mpiexec" else []
    code, out, err, seconds = run(2, [FAULTS, "1", "5", "kill", *LENET, "--max-steps", "500"],
                                  extra)
    assert seconds < 30, err
    watchdog = any("lost rank 1 (host" in line for line in dynar_lines(err))
    # The launcher may end rank 0 before its watchdog's report gets out: by default, and at
    # times despite being told to leave survivors running (MPICH 4.0's Hydra, about 1 run
    # in 40 here). Its own report then names the killed process: Hydra's on stdout, by pid
    # and signal; Open MPI's on stderr, by rank.
    hydra = "Killed (signal 9)" in out
    if launcher == "mpiexec":
        assert watchdog or hydra or "process rank 1" in err, (out, err)
    else:
        assert watchdog or hydra, (out, err)


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_stall_timeout(tmp_path):
    log, marker = tmp_path / "log.jsonl", f"stop-{os.getpid()}-{time.time()}"
    proc = launch(2, ["-m", "dynar.train", *LENET, "--max-steps", "100000", "--log", str(log),
                      "--stall-timeout", "10"], marker=marker)
    try:
        wait_for_steps(log, 5, proc)
        os.kill(rank_pid(marker, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        code, out, err = finish(proc, timeout=40)
    finally:
        proc.kill()
    assert time.monotonic() - stopped <= 25, err
    assert code != 0
    line, = [line for line in dynar_lines(err) if "stall" in line]
    assert "rank 1 (host" in line and "has sent nothing" in line and "--stall-timeout 10" in line


@pytest.mark.slow
def test_a_rank_stuck_in_compute_is_named_as_not_arriving():
    code, out, err, seconds = run(2, [FAULTS, "1", "4", "hang", *LENET, "--max-steps", "500",
                                      "--stall-timeout", "6"])
    assert code != 0 and seconds < 30, err
    line, = [line for line in dynar_lines(err) if "stall" in line]
    assert "waited" in line and "rank 1 (host" in line and "did not arrive" in line, line


def test_an_error_on_the_communication_thread_ends_every_rank():
    code, out, err, seconds = run(2, [FAULTS, "1", "4", "comm", *LENET, "--max-steps", "500"])
    assert code != 0 and seconds < 30, err
    line, = [line for line in err.splitlines() if "error:" in line]
    assert "bucket" in line and "communication thread" in line and "injected fault" in line


def test_the_last_line_before_mpi_abort_waits_for_the_launcher_to_read_it():
    # MPI_Abort takes the launcher's forwarding down with the ranks: under MPICH's Hydra
    # the job's one error line was lost about 1 run in 12 until end_job waited for it.
    read, write = os.pipe()
    with os.fdopen(write, "w") as stream:
        stream.write("error: a line\n")
        stream.flush()
        seen = []
        reader = threading.Timer(0.3, lambda: seen.append(os.read(read, 100)))
        reader.start()
        runtime._wait_until_read(stream, timeout=30)
        assert seen == [b"error: a line\n"]
        stream.write("nobody reads this\n")
        stream.flush()
        start = time.monotonic()
        runtime._wait_until_read(stream, timeout=0.2)      # bounded when nobody reads
        assert time.monotonic() - start < 10
    os.close(read)


# -- stopping on a signal, and resuming --------------------------------------------------


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint(tmp_path):
    log, folder, marker = tmp_path / "log.jsonl", tmp_path / "ckpt", f"term-{os.getpid()}"
    proc = launch(2, ["-m", "dynar.train", *LENET, "--max-steps", "100000", "--log", str(log),
                      "--checkpoint-dir", str(folder)], marker=marker)
    try:
        wait_for_steps(log, 5, proc)
        os.kill(rank_pid(marker, 1), signal.SIGTERM)
        code, out, err = finish(proc, timeout=30)
    finally:
        proc.kill()
    assert code == REQUEUE, err
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    last_step = [r for r in steps if r["event"] == "step"][-1]["step"]
    assert steps[-1]["stopped_by"] == "SIGTERM" and steps[-1]["steps"] == last_step
    saved = checkpoint.load(folder / "last.ckpt")
    assert saved["global_step"] == last_step
    assert f"stopped by SIGTERM after step {last_step}: checkpoint" in out


# 70 steps of the bundled digits (62 per epoch), checkpointed every 10 steps, keeping 2.
RECIPE = ["--model", "lenet", "--epochs", "2", "--max-steps", "70", "--threads", "1",
          "--checkpoint-every", "10", "--keep-last", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, stops", [
    # (rank, step): mid-epoch, at an epoch's last step, mid-epoch again
    (0, [(0, 13), (0, 62), (0, 66)]),
    (2, [(0, 13), (1, 62)])])
def test_a_run_stopped_and_resumed_many_times_is_bitwise_the_uninterrupted_one(tmp_path,
                                                                               ranks, stops):
    # Each time the same command continues with --resume auto; under mpiexec the signal
    # reaches one rank only.
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    code, out, err, _ = run(ranks, ["-m", "dynar.train", *RECIPE, "--checkpoint-dir",
                                    str(straight)], timeout=120)
    assert code == 0, err
    for rank, step in stops + [(None, None)]:
        fault = [FAULTS, str(rank), str(step), "term"] if rank is not None else ["-m", "dynar.train"]
        code, out, err, _ = run(ranks, [*fault, *RECIPE, "--checkpoint-dir", str(requeued),
                                        "--resume", "auto"], timeout=120)
        if rank is None:
            assert code == 0, err
            break
        assert code == REQUEUE, err
        assert f"stopped by SIGTERM after step {step}" in out, out
        kept = sorted(n for n in os.listdir(requeued) if n.endswith(".ckpt") and n != "last.ckpt")
        assert len(kept) <= 2, kept                                   # --keep-last 2
        assert checkpoint.load(requeued / "last.ckpt")["global_step"] == step
    assert assert_bitwise_same_run(straight, requeued) == 70


# -- non-finite values ---------------------------------------------------------------------


def _strict_json(path):
    def refuse(constant):
        raise ValueError(f"{path}: non-standard JSON constant {constant}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# In one process (cheaper): tests/test_checkpoint_dir.py's diverged and skipped runs.
@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_step_and_saves_nothing_non_finite(tmp_path):
    log, folder = tmp_path / "log.jsonl", tmp_path / "ckpt"
    code, out, err, seconds = run(2, ["-m", "dynar.train", *LENET, "--lr", "1e6",
                                      "--max-steps", "50", "--log", str(log),
                                      "--checkpoint-dir", str(folder),
                                      "--checkpoint-every", "1"])
    assert code != 0 and seconds < 30, err
    line, = [line for line in err.splitlines() if "error:" in line]
    assert "non-finite" in line and " at step " in line and "--skip-nonfinite" in line, line
    step = int(re.search(r" at step (\d+)", line).group(1))
    records = _strict_json(log)
    assert [r["step"] for r in records if r["event"] == "step"][-1] == step - 1
    for name in os.listdir(folder):
        if name.endswith(".ckpt"):
            state = checkpoint.load(folder / name)
            assert state["global_step"] < step
            assert all(np.isfinite(v).all() for v in state["model"].values()), name


@pytest.mark.parametrize("skip", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_non_finite_loss_on_one_rank_stops_or_skips_on_every_rank(tmp_path, skip):
    log = tmp_path / "log.jsonl"
    code, out, err, seconds = run(2, [FAULTS, "1", "7", "nan", *LENET, "--max-steps", "12",
                                      "--log", str(log)] + (["--skip-nonfinite"] if skip else []))
    records = _strict_json(log)
    if not skip:
        assert code == 1 and seconds < 30, err
        line, = [line for line in err.splitlines() if "error:" in line]
        assert "non-finite loss (rank 1) and gradient at step 7: lower --lr" in line, line
        return
    assert code == 0, err
    assert [r["step"] for r in records if r.get("skipped")] == [7]
    assert records[-1]["skipped_steps"] == 1 and records[-1]["steps"] == 12


# -- a full disk ---------------------------------------------------------------------------

FULL_DISK = """
set -u
mount -t tmpfs -o size=1100k tmpfs "$1/ckpt" && mount -t tmpfs -o size=24k tmpfs "$1/log" || exit 99
$2 -n 2 "$3" -m dynar.train $4 --max-steps 200 \\
    --checkpoint-dir "$1/ckpt" --checkpoint-every 3 > "$1/ckpt.out" 2>&1
echo "checkpoints $?"
"$3" -c "
import os, sys
from dynar import checkpoint
from dynar.dist import runtime
state = checkpoint.load(sys.argv[1] + '/last.ckpt')
print('loads', state['global_step'], sorted(n for n in os.listdir(sys.argv[1]) if '.tmp' in n))
" "$1/ckpt"
$2 -n 2 "$3" -m dynar.train $4 --max-steps 2000 \\
    --log "$1/log/log.jsonl" > "$1/log.out" 2>&1
echo "log $?"
"""


@pytest.mark.root
@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_loads(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounts a small tmpfs: needs root and unshare")
    for sub in ("ckpt", "log"):
        (tmp_path / sub).mkdir()
    # In a mount namespace of its own: the tmpfs mounts go away with it, whatever happens.
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", FULL_DISK,
                           "sh", str(tmp_path), " ".join(mpiexec()), sys.executable,
                           " ".join(LENET)],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=ROOT)
    results = done.stdout.split("\n")
    ckpt_out = (tmp_path / "ckpt.out").read_text()
    line, = [line for line in ckpt_out.splitlines() if "error:" in line]
    assert "cannot write checkpoint" in line and "No space left on device" in line, ckpt_out
    assert "the earlier checkpoints are kept" in line
    assert "checkpoints 1" in results, done.stdout + done.stderr
    loads = [r for r in results if r.startswith("loads ")]
    assert loads and loads[0].endswith(" []"), done.stdout + done.stderr     # no temporary left
    log_out = (tmp_path / "log.out").read_text()
    assert "cannot write the log" in log_out and "No space left on device" in log_out, log_out
    assert "log 0" not in results, done.stdout
