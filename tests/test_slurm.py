"""dynar under a real Slurm (perf/cluster/slurm.py: Debian's munged, slurmctld and one slurmd
per emulated host): `sbatch` of a job script that calls mpiexec inside the allocation, and
`srun --mpi=pmix`, each on 2 Slurm nodes x 1 rank, train LeNet to the weights a 1-rank run
reaches; the ranks take their threads from Slurm's --cpus-per-task; a tuning file made on
other hosts serves the job; a job `scontrol requeue`d mid-run, or signalled ahead of its
time limit, starts again by itself and ends bitwise as one that was not; srun without the
MPI plugin is refused; and the cluster's daemons are gone after its owner's SIGTERM or
SIGKILL (then `cleanup`).

Needs root and the Debian packages (slurmd, slurmctld, slurm-client, munge, libpmix2,
libpmix-dev); elsewhere it skips, naming what is missing."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dynar import checkpoint
from perf.cluster import Cluster
from perf.cluster import slurm as slurm_cluster
from support.cluster import ROOT, assert_gone, cli, start_owner
from support.markers import expect_marker
from support.runs import assert_bitwise_same_run

pytestmark = [pytest.mark.root, pytest.mark.mpi]

RATE = "10gbit"
TRAIN = ["--model", "lenet", "--batch-size", "32", "--max-steps", "24", "--eval-every", "0"]
JOB_TIMEOUT = 120


def require_slurm():
    expect_marker("root", "builds network namespaces and runs Slurm's daemons")
    ok, reason = slurm_cluster.available()
    if not ok:
        pytest.skip(f"Slurm cluster unavailable: {reason}")


@pytest.fixture(scope="module")
def tune_dir(tmp_path_factory):
    """A tuning file made by `python -m dynar.tune` on another emulated cluster (other host
    names) of the same shape as the Slurm jobs: 2 nodes x 1 rank, same MPI, same link."""
    require_slurm()
    directory = tmp_path_factory.mktemp("tune")
    with Cluster(hosts=2, ranks_per_host=1, rate=RATE) as c:
        done = c.run([sys.executable, "-m", "dynar.tune", "--sizes", "4096,65536",
                      "--repeats", "1"], env={"DYNAR_TUNE_DIR": str(directory)},
                     timeout=JOB_TIMEOUT, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    files = list(directory.glob("*.json"))
    assert len(files) == 1, files
    return directory


@pytest.fixture(scope="module")
def slurm():
    require_slurm()
    with slurm_cluster.SlurmCluster(hosts=2, rate=RATE) as s:
        yield s


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The weights of the same training run on one process."""
    out = tmp_path_factory.mktemp("one-rank")
    done = subprocess.run([sys.executable, "-m", "dynar.train", *TRAIN, "--threads", "1",
                           "--checkpoint-dir", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=JOB_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return checkpoint.load(out / "last.ckpt")


def without_thread_settings(monkeypatch):
    """The jobs inherit this environment (sbatch --export=ALL): leave the thread count to
    Slurm's --cpus-per-task."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)


def assert_same_training(ckpt_dir, reference):
    # Two ranks sum each batch's gradients in another order than one: float32 rounding,
    # a few ulps a step (the tolerances of test_dist_train.py).
    trained = checkpoint.load(ckpt_dir / "last.ckpt")
    assert trained["global_step"] == reference["global_step"] == 24
    for name, value in reference["model"].items():
        np.testing.assert_allclose(trained["model"][name], value, rtol=1e-4, atol=2e-5,
                                   err_msg=name)


def planned_from(log):
    plans = [json.loads(line) for line in log.read_text().splitlines() if '"plan"' in line]
    assert plans, "no plan event in the log"
    return plans[0]["source"]


JOB_SCRIPT = """\
#!/bin/sh
# What a user's job script does: the MPI's own launcher inside the allocation.
exec mpiexec --bind-to none {python} -m dynar.train "$@"
"""


def test_sbatch_job_calling_mpiexec_trains_as_one_rank_does(slurm, one_rank, tune_dir,
                                                            tmp_path, monkeypatch):
    without_thread_settings(monkeypatch)
    script = tmp_path / "job.sh"
    script.write_text(JOB_SCRIPT.format(python=sys.executable))
    out, log = tmp_path / "job.out", tmp_path / "log.jsonl"
    job_id = slurm.sbatch(str(script), [*TRAIN, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                        "--log", str(log)],
                          ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                           f"--output={out}"], env={"DYNAR_TUNE_DIR": str(tune_dir)},
                          cwd=ROOT)
    job = slurm.wait(job_id, timeout=JOB_TIMEOUT)
    text = out.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert job["NodeList"] == f"dynar-{slurm.run_id}-h[0-1]"
    assert "2 rank(s) x 1 thread(s) (SLURM_CPUS_PER_TASK=1)" in text
    assert_same_training(tmp_path / "ckpt", one_rank)
    # The tuning file was made on the other cluster's hosts: same shape, so it is used.
    assert planned_from(log) == f"tuning file {next(tune_dir.glob('*.json')).stem}"


def test_srun_with_pmix_trains_as_one_rank_does(slurm, one_rank, tmp_path, monkeypatch):
    without_thread_settings(monkeypatch)
    done = slurm.srun([sys.executable, "-m", "dynar.train", *TRAIN,
                       "--checkpoint-dir", str(tmp_path / "ckpt")],
                      ["--mpi=pmix", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1"],
                      env={"DYNAR_TUNE_DIR": str(tmp_path / "tune")}, timeout=JOB_TIMEOUT,
                      cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 rank(s) x 1 thread(s) (SLURM_CPUS_PER_TASK=1)" in done.stdout
    assert_same_training(tmp_path / "ckpt", one_rank)


JOB_SCRIPT_USERS_START_FROM = os.path.join(ROOT, "examples", "slurm", "train.sbatch")


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_the_shipped_job_script_trains_as_one_rank_does(slurm, one_rank, launcher, tmp_path,
                                                        monkeypatch):
    without_thread_settings(monkeypatch)
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    # The script's own #SBATCH lines ask for 16 CPUs a task; these hosts have 2 between them.
    # Its SIGUSR1 comes 300 s before the time limit: a limit of 300 s or less signals at once.
    job_id = slurm.sbatch(JOB_SCRIPT_USERS_START_FROM, TRAIN,
                          ["--cpus-per-task=1", "--time=00:30:00", f"--output={out}"],
                          env={"DYNAR_LAUNCHER": launcher, "DYNAR_PYTHON": sys.executable,
                               "DYNAR_CHECKPOINT_DIR": str(ckpt),
                               "DYNAR_TUNE_DIR": str(tmp_path / "tune")}, cwd=ROOT)
    job = slurm.wait(job_id, timeout=JOB_TIMEOUT)
    text = out.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert f"train.sbatch: job {job_id} (restart 0)" in text
    assert "2 rank(s) x 1 thread(s) (SLURM_CPUS_PER_TASK=1)" in text
    assert_same_training(ckpt, one_rank)


# Long enough to be requeued mid-run: 30 epochs of the bundled digits, 7 steps each.
REQUEUED = ["--model", "lenet", "--batch-size", "512", "--epochs", "30", "--eval-every", "0"]


def steps_logged(log):
    return log.read_text().count('"event": "step"') if log.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scontrol requeue", "time limit"])
def test_a_job_requeued_mid_run_resumes_by_itself_and_ends_bitwise_unrequeued(
        slurm, how, tmp_path, monkeypatch):
    # The shipped script, twice at once: one job runs through, the other is stopped mid-run
    # and Slurm starts it again by itself; its `--resume auto` continues from the checkpoint.
    # - `scontrol requeue`: SIGTERM to every process (one checkpoint, exit 75);
    # - near the time limit: SIGUSR1 to the batch shell (what --signal=B:USR1@300 sends),
    #   which passes it to the ranks (one checkpoint, exit 75) and requeues the job itself.
    without_thread_settings(monkeypatch)
    jobs = {}
    for name in ("straight", "requeued"):
        out, log = tmp_path / f"{name}.out", tmp_path / f"{name}.jsonl"
        job_id = slurm.sbatch(JOB_SCRIPT_USERS_START_FROM, [*REQUEUED, "--log", str(log)],
                              ["--cpus-per-task=1", "--time=00:30:00", f"--output={out}"],
                              env={"DYNAR_PYTHON": sys.executable,
                                   "DYNAR_CHECKPOINT_DIR": str(tmp_path / name),
                                   "DYNAR_CHECKPOINT_EVERY": "20",
                                   "DYNAR_TUNE_DIR": str(tmp_path / "tune")}, cwd=ROOT)
        jobs[name] = job_id, out, log
    job_id, out, log = jobs["requeued"]
    deadline = time.monotonic() + JOB_TIMEOUT
    while steps_logged(log) < 45:
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.05)
    if how == "scontrol requeue":
        slurm.requeue(job_id)
    else:
        slurm.client("scancel", "--batch", "--signal=USR1", job_id)
    for name, (job_id, out, _) in jobs.items():
        job = slurm.wait(job_id, timeout=2 * JOB_TIMEOUT)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out.read_text()
        assert job["Restarts"] == ("1" if name == "requeued" else "0")
    text = jobs["requeued"][1].read_text()
    signal_name = "SIGTERM" if how == "scontrol requeue" else "SIGUSR1"
    stopped = re.search(fr"stopped by {signal_name} after step (\d+): checkpoint", text)
    assert stopped and int(stopped.group(1)) >= 45, text
    if how == "time limit":
        assert ("checkpointed before the time limit; requeueing job "
                f"{jobs['requeued'][0]}") in text
    assert f"job {jobs['requeued'][0]} (restart 1)" in text
    total = assert_bitwise_same_run(tmp_path / "straight", tmp_path / "requeued")
    assert int(stopped.group(1)) < total


def test_srun_without_the_mpi_plugin_is_refused_not_trained_twice(slurm):
    # Without PMIx each task comes up as an MPI job of one; training on would run the
    # whole job twice over, both writing the same checkpoints.
    done = slurm.srun([sys.executable, "-m", "dynar.train", *TRAIN],
                      ["--mpi=none", "--nodes=2", "--ntasks-per-node=1"], timeout=JOB_TIMEOUT,
                      cwd=ROOT)
    assert done.returncode != 0
    assert done.stderr.count("srun started 2 tasks but each is an MPI job of one") == 2, \
        done.stderr
    assert "Traceback" not in done.stderr


OWNER = textwrap.dedent("""
    import sys
    from perf.cluster.slurm import SlurmCluster
    with SlurmCluster(hosts=2) as s:
        print(s.run_id, *s.daemon_pids(), flush=True)
        s.srun(["sleep", "300"], ["--nodes=2", "--ntasks-per-node=1"])
""")


def start_slurm_owner():
    """(owner, run id, every pid of its cluster: daemons and the job's processes)."""
    require_slurm()
    # slurmd and a slurmstepd and `sleep` on each host, then the daemons' own pids.
    owner, (run_id, *daemons), in_hosts = start_owner(OWNER, processes=6)
    return owner, run_id, in_hosts + [int(p) for p in daemons]


def test_sigterm_stops_the_daemons_and_removes_everything():
    owner, run_id, pids = start_slurm_owner()
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=60) != 0
    assert_gone(run_id, pids)


def test_sigkill_leaves_nothing_that_cleanup_does_not_remove():
    owner, run_id, pids = start_slurm_owner()
    owner.kill()
    owner.wait(timeout=10)
    proc = cli("cleanup")
    assert proc.returncode == 0, proc.stderr
    assert run_id in proc.stdout
    assert_gone(run_id, pids)
