"""--checkpoint-dir's rules: one job at a time, unfinished files of a killed writer removed,
--resume auto's choice (newest that loads, or a fresh start), --keep-last, and a checkpoint
never written with non-finite values."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynar import checkpoint
from dynar.train import TrainConfig, train
from dynar.train.checkpoint_dir import CheckpointDir, CheckpointDirInUse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = dict(model="lenet", dataset="synthetic", batch_size=16, eval_every=0, threads=1)

HOLDER = """
import sys, time
from dynar.train.checkpoint_dir import CheckpointDir
held = CheckpointDir(sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


def test_a_folder_in_use_is_refused_naming_its_holder_until_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(CheckpointDirInUse) as refused:
            train(TrainConfig(checkpoint_dir=str(tmp_path), max_steps=2, **SHORT))
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and "host " in message and str(tmp_path) in message
    finally:
        holder.kill()
        holder.wait()
    # The lock died with its holder: the folder is free.
    assert train(TrainConfig(checkpoint_dir=str(tmp_path), max_steps=2, **SHORT)).summary


def test_unfinished_files_of_a_killed_writer_are_removed(tmp_path, capsys):
    stale = tmp_path / ".step_0000004.ckpt.4242.0123abcd.tmp"   # atomic_write's naming
    stale.write_bytes(b"half a checkpoint")
    mine = tmp_path / "notes.tmp"                                # not ours: kept
    mine.write_text("x")
    CheckpointDir(str(tmp_path)).close()
    assert not stale.exists() and mine.exists()
    assert "removed 1 unfinished checkpoint file(s)" in capsys.readouterr().err


def test_resume_auto_starts_fresh_then_continues_from_the_newest(tmp_path):
    cfg = dict(checkpoint_dir=str(tmp_path), resume="auto", **SHORT)
    assert train(TrainConfig(max_steps=3, **cfg)).summary["steps"] == 3     # nothing there
    done = train(TrainConfig(max_steps=5, checkpoint_every=1, keep_last=2, **cfg))
    assert done.summary["steps"] == 5
    kept = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))
    assert kept == ["last.ckpt", "step_0000004.ckpt", "step_0000005.ckpt"], kept
    assert os.path.samefile(tmp_path / "last.ckpt", tmp_path / "step_0000005.ckpt")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path,
                                                                                capsys):
    cfg = dict(checkpoint_dir=str(tmp_path), **SHORT)
    train(TrainConfig(max_steps=4, checkpoint_every=2, **cfg))
    newest = tmp_path / "step_0000004.ckpt"
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF                    # last.ckpt is the same file: both damaged
    newest.write_bytes(bytes(blob))
    capsys.readouterr()
    done = train(TrainConfig(max_steps=6, resume="auto", **cfg))
    err = capsys.readouterr().err
    assert "step_0000004.ckpt: " in err and "set aside as step_0000004.ckpt.corrupt" in err, err
    assert done.summary["steps"] == 6
    assert (tmp_path / "step_0000004.ckpt.corrupt").exists()
    # It went on from step 2: the same steps as a run that was never damaged.
    straight = tmp_path / "straight"
    train(TrainConfig(max_steps=6, **dict(cfg, checkpoint_dir=str(straight))))
    a, b = checkpoint.load(straight / "last.ckpt"), checkpoint.load(tmp_path / "last.ckpt")
    assert all(np.array_equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_run_that_starts_behind_sets_newer_checkpoints_aside(tmp_path, capsys):
    cfg = dict(checkpoint_dir=str(tmp_path), **SHORT)
    train(TrainConfig(max_steps=6, checkpoint_every=3, **cfg))
    capsys.readouterr()
    train(TrainConfig(max_steps=2, **cfg))          # a fresh start in the same folder
    assert "2 newer checkpoint(s) of another run set aside" in capsys.readouterr().err
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".superseded")) == \
        ["step_0000003.ckpt.superseded", "step_0000006.ckpt.superseded"]
    # --resume auto now continues this run, not the one set aside.
    assert train(TrainConfig(max_steps=4, resume="auto", **cfg)).summary["steps"] == 4
    assert checkpoint.load(tmp_path / "last.ckpt")["global_step"] == 4


def test_a_diverged_run_writes_no_checkpoint_and_logs_strict_json(tmp_path):
    log, folder = tmp_path / "log.jsonl", tmp_path / "ckpt"
    from dynar.dist import NonFiniteError
    with pytest.raises(NonFiniteError, match=r"non-finite loss (and gradient )?at step \d+$"):
        train(TrainConfig(lr=1e6, max_steps=50, checkpoint_every=1, log=str(log),
                          checkpoint_dir=str(folder), **SHORT))
    for line in log.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in the log"))
    for name in os.listdir(folder):
        if name.endswith(".ckpt"):
            assert np.isfinite(checkpoint.load(folder / name)["model"]["conv1.weight"]).all()


def test_skipped_steps_leave_the_model_alone_and_are_counted(tmp_path):
    log = tmp_path / "log.jsonl"
    done = train(TrainConfig(lr=1e6, max_steps=8, skip_nonfinite=True, log=str(log), **SHORT))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped and done.summary["skipped_steps"] == len(skipped)
    assert np.isfinite(done.model.flat_params).all()
    assert any(r["loss"] is None for r in records if r.get("skipped"))    # NaN: null
