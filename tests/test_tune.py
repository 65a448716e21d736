"""python -m dynar.tune: measures every algorithm under mpiexec and writes a tuning file that
a dynamic-sync training job of the same shape then loads instead of tuning itself."""
import json
import subprocess
import sys

from mpirun import ROOT, launcher_is_hydra, run_mpi


def test_tune_writes_a_file_that_training_then_loads(tmp_path):
    # Each rank keeping its own replica: with one shared replica on this single node there
    # would be no allreduce among nodes to tune or plan (the next test).
    env = {"DYNAR_TUNE_DIR": str(tmp_path), "DYNAR_NODE_REPLICA": "off"}
    # Up to 8 MB: a loaded machine's scheduling noise (0.4 ms on a 4 KB call, seen) must not
    # hide the per-byte cost.
    done = run_mpi(2, ["-m", "dynar.tune", "--sizes", "4096,1048576,8388608", "--repeats", "2"],
                   env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    saved = json.loads(files[0].read_text())
    assert saved["meta"]["ranks"] == 2 and saved["meta"]["sizes"] == [4096, 1048576, 8388608]
    algorithms = saved["model"]["algorithms"]
    assert set(algorithms) == {"mpi", "ring", "recursive_doubling", "rabenseifner",
                               "hierarchical"}
    # MPICH's busy-polling ranks on a shared 2-core machine made 1 MB allreduces no slower
    # than 4 KB ones (the notes of 2026-12-02): a fit with no per-byte cost is all it gives.
    assert all(c["alpha"] >= 0 and c["beta"] >= 0 for c in algorithms.values()), algorithms
    if not launcher_is_hydra():
        assert all(c["beta"] > 0 for c in algorithms.values()), algorithms

    log = tmp_path / "log.jsonl"
    done = run_mpi(2, ["-m", "dynar.train", "--dataset", "synthetic", "--max-steps", "12",
                       "--eval-every", "0", "--threads", "1", "--log", str(log)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [json.loads(line) for line in log.read_text().splitlines()
             if '"plan"' in line]
    assert plans and plans[0]["source"] == f"tuning file {files[0].stem}", plans
    assert len(list(tmp_path.glob("*.json"))) == 1     # loaded, not re-tuned

    # A damaged file (a NaN cost) is re-tuned with a warning, and replaced.
    saved["model"]["algorithms"]["ring"]["beta"] = float("nan")
    files[0].write_text(json.dumps(saved))
    log.unlink()
    done = run_mpi(2, ["-m", "dynar.train", "--dataset", "synthetic", "--max-steps", "8",
                       "--eval-every", "0", "--threads", "1", "--log", str(log)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"warning: {files[0]}: " in done.stderr and "tuning again" in done.stderr
    plans = [json.loads(line) for line in log.read_text().splitlines() if '"plan"' in line]
    assert plans[0]["source"].startswith("brief tune"), plans
    assert "NaN" not in files[0].read_text()


def test_a_tuning_file_that_cannot_be_written_does_not_stop_training(tmp_path):
    # The directory's parent is a file: no mkdir succeeds, even as root.
    (tmp_path / "taken").write_text("")
    env = {"DYNAR_TUNE_DIR": str(tmp_path / "taken" / "tune"), "DYNAR_NODE_REPLICA": "off"}
    log = tmp_path / "log.jsonl"
    done = run_mpi(2, ["-m", "dynar.train", "--dataset", "synthetic", "--max-steps", "12",
                       "--eval-every", "0", "--threads", "1", "--log", str(log)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cannot save the tuning file" in done.stderr and "Traceback" not in done.stderr
    plans = [json.loads(line) for line in log.read_text().splitlines() if '"plan"' in line]
    assert plans and plans[0]["source"].startswith("brief tune"), plans


def test_tune_on_one_node_with_a_shared_replica_has_nothing_to_tune(tmp_path):
    done = run_mpi(2, ["-m", "dynar.tune", "--sizes", "4096,65536", "--repeats", "1"],
                   env={"DYNAR_TUNE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing to tune" in done.stdout
    assert not list(tmp_path.glob("*.json"))


def test_tune_refuses_a_single_process():
    done = subprocess.run([sys.executable, "-m", "dynar.tune"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "run under mpiexec with 2 or more ranks" in done.stderr
    assert "Traceback" not in done.stderr
