"""dynar.checkpoint: bitwise round trips, atomic replacement, corrupt files detected."""
import os
import random
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from dynar import checkpoint


def example_state(rng):
    generator = np.random.default_rng(42)
    generator.random(3)
    return {
        "model": {"conv1.weight": rng.standard_normal((6, 1, 5, 5)).astype(np.float32),
                  "bn1.running_var": rng.random(6),  # float64
                  "bn1.num_batches_tracked": np.array(17, np.int64),
                  "fc.half": rng.random(4).astype(np.float16),
                  "big_endian": rng.random(3).astype(">f4"),
                  "mask": rng.random(5) < 0.5,
                  "empty": np.zeros((0, 3), np.float32),
                  "specials": np.array([np.nan, np.inf, -0.0], np.float32)},
        "optimizer": {"lr": 0.1, "momentum": 0.9, "state": {0: {"momentum_buffer": rng.random(7)}, 1: None}},
        "schedule": {"name": "cosine", "milestones": [30, 60], "warmup": (5, 0.01), "nan": float("nan")},
        "epoch": 3, "step": 1200, "done": False,
        "rng": generator.bit_generator.state,  # nested dict with 128-bit ints
        "python_rng": random.Random(5).getstate(),
        "scalar": np.float32(2.5), "unicode": "résumé ✓",
    }


def assert_same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # bitwise, NaNs included
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def test_round_trip_is_bitwise(tmp_path, rng):
    state = example_state(rng)
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, state)
    loaded = checkpoint.load(path)
    assert_same(state, loaded)
    generator = np.random.default_rng()
    generator.bit_generator.state = loaded["rng"]
    assert generator.random() == np.random.default_rng(42).random(4)[3]
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary left behind


def test_unsupported_values_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"state\['model'\]\['w'\]: object arrays"):
        checkpoint.save(tmp_path / "a", {"model": {"w": np.array([{}], dtype=object)}})
    with pytest.raises(TypeError, match="set"):
        checkpoint.save(tmp_path / "a", {"s": {1, 2}})
    with pytest.raises(TypeError, match="key"):
        checkpoint.save(tmp_path / "a", {(1, 2): 3})
    with pytest.raises(TypeError, match="dict"):
        checkpoint.save(tmp_path / "a", [1])
    assert os.listdir(tmp_path) == []


def test_failed_replace_keeps_previous_checkpoint(tmp_path, rng, monkeypatch):
    path = tmp_path / "ckpt.npz"
    old = example_state(rng)
    checkpoint.save(path, old)

    def broken_replace(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(path, {"model": {"w": np.ones(10)}, "epoch": 4})
    monkeypatch.undo()
    assert_same(old, checkpoint.load(path))
    assert os.listdir(tmp_path) == ["ckpt.npz"]


WRITER = """
import sys, numpy as np
from dynar import checkpoint
path = sys.argv[1]
big = np.arange(4_000_000, dtype=np.float32)
for epoch in range(10**6):
    checkpoint.save(path, {"model": {"w": big + epoch}, "epoch": epoch})
    print(epoch, flush=True)
"""


def test_kill_during_writes_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL a process that rewrites a 16 MB checkpoint in a loop, while a write is under way."""
    path = tmp_path / "ckpt.npz"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo] + sys.path))
    killed_mid_write = 0
    for delay in (0.0, 0.004, 0.011):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                                env=env, cwd=repo)
        proc.stdout.readline()  # at least one checkpoint is complete
        deadline = time.monotonic() + 30
        while not any(name.endswith(".tmp") for name in os.listdir(tmp_path)):  # a write has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        proc.stdout.close()
        state = checkpoint.load(path)
        np.testing.assert_array_equal(state["model"]["w"][:3], np.arange(3) + state["epoch"])
        # what a killed writer can leave is a hidden *.tmp file, never something at `path`
        leftovers = [name for name in os.listdir(tmp_path) if name != "ckpt.npz"]
        assert all(name.startswith(".ckpt.npz.") and name.endswith(".tmp") for name in leftovers)
        killed_mid_write += len(leftovers) > 0
        for name in leftovers:
            os.remove(tmp_path / name)
    assert killed_mid_write > 0  # otherwise the test did not exercise what it claims to


def assert_checkpoint_error(path, words=""):
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and words in message
    return message


def test_missing_truncated_and_garbage(tmp_path, rng):
    assert_checkpoint_error(tmp_path / "nope.npz", "no such checkpoint")
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, example_state(rng))
    blob = path.read_bytes()
    for cut in (0, 10, len(blob) // 3, len(blob) // 2, len(blob) - 30, len(blob) - 1):
        path.write_bytes(blob[:cut])
        assert_checkpoint_error(path)
    path.write_bytes(b"not a checkpoint at all" * 100)
    assert_checkpoint_error(path)


def test_flipped_bytes_are_detected(tmp_path, rng):
    """A flipped byte in any entry's data is an error; elsewhere (zip header fields the reader
    ignores, such as timestamps) it is either an error or harmless: never a silent change."""
    path = tmp_path / "ckpt.npz"
    state = example_state(rng)
    checkpoint.save(path, state)
    blob = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        payload = [(i.header_offset + 30 + len(i.filename) + len(i.extra), i.compress_size)
                   for i in z.infolist()]
    positions = np.random.default_rng(1).integers(0, len(blob), 40).tolist()
    positions += [start + size // 2 for start, size in payload]
    for position in positions:
        damaged = bytearray(blob)
        damaged[position] ^= 0x41
        path.write_bytes(bytes(damaged))
        if any(start <= position < start + size for start, size in payload):
            assert_checkpoint_error(path)
        else:
            try:
                assert_same(state, checkpoint.load(path))
            except checkpoint.CheckpointError as e:
                assert str(path) in str(e)


def test_checksum_catches_consistent_zip_with_wrong_data(tmp_path):
    """Arrays swapped inside a well-formed zip (CRCs valid) fail the SHA-256 check."""
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, {"model": {"w": np.zeros(4)}})
    with np.load(path) as archive:
        members = {name: archive[name] for name in archive.files}
    members["a0"] = np.ones(4)
    np.savez(path, **members)
    assert_checkpoint_error(path, "checksum")


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, weights=np.zeros(3))
    assert_checkpoint_error(path, "not a dynar checkpoint")
    np.save(tmp_path / "bare.npy", np.zeros(3))
    assert_checkpoint_error(tmp_path / "bare.npy", "not a dynar checkpoint")
    checkpoint.save(path, {"a": 1})
    with np.load(path) as archive:
        tree = archive["tree"]
        meta = archive["meta"].tobytes().replace(b'"version": 1', b'"version": 99')
    np.savez(path, tree=tree, meta=np.frombuffer(meta, np.uint8))
    assert_checkpoint_error(path, "version 99")
