"""Tuning files (dist/tuning.py): keyed by the job's shape (not its hosts), written
atomically, and refused with the file's name when corrupt, foreign or measured on messages
too small."""
import json
import re

import pytest

from dynar.dist import interconnect, tuning
from dynar.dist.costmodel import CostModel, LinkModel


def test_tuning_key_names_the_shape_not_the_hosts():
    key = tuning.tuning_key(8, 4, 2, "Open MPI v5.0.3", "ethernet 25 Gb/s")
    assert key == tuning.tuning_key(8, 4, 2, "Open MPI v5.0.3", "ethernet 25 Gb/s")
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    others = [tuning.tuning_key(16, 4, 4, "Open MPI v5.0.3", "ethernet 25 Gb/s"),
              tuning.tuning_key(8, 2, 4, "Open MPI v5.0.3", "ethernet 25 Gb/s"),
              tuning.tuning_key(8, 4, 2, "MPICH Version: 4.2", "ethernet 25 Gb/s"),
              tuning.tuning_key(8, 4, 2, "Open MPI v5.0.3", "infiniband 200 Gb/sec (4X HDR)")]
    assert key not in others and len(set(others)) == len(others)


def _fake_device(sysfs, name, type_, operstate, speed=None, hardware=True):
    dev = sysfs / "class" / "net" / name
    dev.mkdir(parents=True)
    (dev / "type").write_text(f"{type_}\n")
    (dev / "operstate").write_text(f"{operstate}\n")
    if speed is not None:
        (dev / "speed").write_text(f"{speed}\n")
    if hardware:
        (dev / "device").mkdir()


def test_interconnect_is_the_hardware_devices_that_are_up(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAR_LINK", raising=False)
    assert interconnect.describe(tmp_path) == "no hardware network device"
    _fake_device(tmp_path, "eno1", 1, "up", 25000)
    _fake_device(tmp_path, "eno2", 1, "down", 1000)                  # not carrying traffic
    _fake_device(tmp_path, "lo", 772, "unknown", hardware=False)
    _fake_device(tmp_path, "dynar-ab12-v0", 1, "up", 10000, hardware=False)   # a veth
    _fake_device(tmp_path, "ens3", 1, "up", -1)                       # virtio: no speed
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert interconnect.describe(tmp_path) == ("ethernet 25 Gb/s, ethernet, speed not "
                                               "reported, infiniband 200 Gb/sec (4X HDR)")
    monkeypatch.setenv("DYNAR_LINK", "site fabric A")
    assert interconnect.describe(tmp_path) == "site fabric A"


def test_tuning_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNAR_TUNE_DIR", str(tmp_path / "tune"))
    assert tuning.tuning_dir() == tmp_path / "tune"
    monkeypatch.delenv("DYNAR_TUNE_DIR")
    assert tuning.tuning_dir().parts[-3:] == (".cache", "dynar", "tune")


def test_tuning_save_load_round_trip(tmp_path, monkeypatch):
    model = CostModel.from_link(LinkModel(2e-6, 1e-10, 5e-11), 8, 4)
    key = tuning.tuning_key(8, 4, 2, "mpi", "a")
    meta = {"ranks": 8, "ranks_per_node": 4, "nodes": 2, "mpi_library": "mpi", "link": "a"}
    assert tuning.load_tuning(key, tmp_path) is None
    path = tuning.save_tuning(model, key, meta, directory=tmp_path / "sub")
    assert path == tmp_path / "sub" / f"{key}.json"
    assert tuning.load_tuning(key, tmp_path / "sub") == model
    assert json.loads(path.read_text())["meta"] == meta
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temp file left
    # Saving again replaces the file; the default directory is $DYNAR_TUNE_DIR.
    monkeypatch.setenv("DYNAR_TUNE_DIR", str(tmp_path / "sub"))
    other = CostModel.default(8, 4)
    tuning.save_tuning(other, key, meta)
    assert tuning.load_tuning(key) == other


def test_a_tuning_file_fitted_on_small_messages_is_not_used_for_big_buckets(tmp_path):
    model = CostModel.default(4)
    key = tuning.tuning_key(4, 1, 4, "mpi", "a")
    tuning.save_tuning(model, key, {"sizes": [4096, 65536, 262144]}, tmp_path)
    assert tuning.load_tuning(key, tmp_path, largest=262144) == model
    assert tuning.load_tuning(key, tmp_path, largest=1 << 20) is None     # re-tune instead


def test_corrupt_or_foreign_tuning_file_names_the_file(tmp_path):
    key = tuning.tuning_key(4, 1, 4, "mpi", "a")
    path = tmp_path / f"{key}.json"
    path.write_text('{"format": "dynar-tuning", "ver')
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*corrupt"):
        tuning.load_tuning(key, tmp_path)
    path.write_text(json.dumps({"something": "else"}))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not a dynar tuning"):
        tuning.load_tuning(key, tmp_path)
    # A valid file saved under another key and renamed is refused, not trusted.
    other = tuning.tuning_key(4, 1, 4, "mpi", "b")
    tuning.save_tuning(CostModel.default(4), other, {}, tmp_path).replace(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + f".*expected '{key}'"):
        tuning.load_tuning(key, tmp_path)
    # A damaged model section also names the file.
    data = json.loads(path.read_text())
    data["key"], data["model"] = key, {"ranks": 4}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*not a cost model"):
        tuning.load_tuning(key, tmp_path)


@pytest.mark.parametrize("damage, words", [
    (lambda d: d.update(meta="not an object"), "malformed tuning file (meta"),
    (lambda d: d["meta"].update(sizes="4096"), "malformed tuning file (meta"),
    (lambda d: d["meta"].update(sizes=[4096, -1]), "malformed tuning file (meta"),
    (lambda d: d["model"]["algorithms"]["ring"].update(beta=float("nan")), "ring beta"),
    (lambda d: d["model"]["algorithms"]["mpi"].update(alpha=-1e-6), "mpi alpha"),
    (lambda d: d["model"]["link"].update(gamma=float("inf")), "link gamma"),
    (lambda d: d["model"]["algorithms"]["ring"].update(alpha="fast"), "ring alpha"),
])
def test_a_malformed_tuning_file_is_an_error_naming_it(tmp_path, damage, words):
    # cost_model_for turns it into a warning and a fresh tune (tests/test_tune.py).
    key = tuning.tuning_key(4, 1, 4, "mpi", "a")
    path = tuning.save_tuning(CostModel.default(4), key, {"sizes": [4096, 65536]}, tmp_path)
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(words)):
        tuning.load_tuning(key, tmp_path)


def test_tuning_key_must_be_a_plain_name(tmp_path):
    with pytest.raises(ValueError, match="tuning key"):
        tuning.load_tuning("../escape", tmp_path)
    with pytest.raises(ValueError, match="tuning key"):
        tuning.save_tuning(CostModel.default(2), "a/b", {}, tmp_path)
