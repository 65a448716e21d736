"""Image folders and packed shards: decoding, torchvision's transforms against a reference
restated here, rank-count invariance, packing (interrupted too), and every bad input's
one-line error. The folders are cut from real photographs (tests/support/photos.py)."""
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from dynar import checkpoint, data
from dynar.data import packer, transforms
from dynar.data.decode import Opened, Record
from dynar.train import TrainConfig, train
from support import photos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 32                                  # crops of the tests' models (alexnet, cifar)
MEAN, STD = np.array(data.dataset.IMAGENET_MEAN), np.array(data.dataset.IMAGENET_STD)


@pytest.fixture(scope="session")
def photo():
    return photos.photographs()[0]


@pytest.fixture(scope="session")
def folder(tmp_path_factory, photo):
    """4 classes x (6 train + 2 val) cut photographs, and the valid edge cases in class 0."""
    root = tmp_path_factory.mktemp("photos")
    photos.build_folder(root, classes=4, train_per_class=6, val_per_class=2)
    photos.edge_cases(root / "train" / "class_00", photo)
    return root


@pytest.fixture(scope="session")
def packed_keep(tmp_path_factory, folder):
    """The folder packed at its own resolution, in small shards."""
    dest = tmp_path_factory.mktemp("packed") / "keep"
    packer.pack(str(folder), str(dest), size=None, shard_mb=0.1, stream=open(os.devnull, "w"))
    return dest


def load(name, path, size=SIZE):
    return data.load(name, data_dir=str(path), model_input_shape=(3, size, size))


def all_batches(ds, split="train", epochs=(0, 1), **kw):
    loader = data.Loader(ds, 8, split=split, seed=5, **kw)
    out = [(x.copy(), y.copy()) for e in epochs for x, y in loader.batches(e)]
    loader.close()
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


# ------------------------------------------------------------------ folder layout and packing

def test_classes_are_the_sorted_train_folders(folder):
    ds = load("imagefolder", folder)
    assert ds.classes == ["class_00", "class_01", "class_02", "class_03"]
    assert len(ds.y_train) == 4 * 6 + len(os.listdir(folder / "train" / "class_00")) - 6
    assert np.all(np.diff(ds.y_train) >= 0) and len(ds.y_test) == 8


@pytest.mark.parametrize("augment", [True, False])
def test_imagefolder_and_packed_give_identical_batches(folder, packed_keep, augment):
    a, b = load("imagefolder", folder), load("packed", packed_keep)
    assert a.classes == b.classes and b.augment_by_default
    assert_same_batches(all_batches(a, augment=augment), all_batches(b, augment=augment))
    assert_same_batches(all_batches(a, "test", (0,)), all_batches(b, "test", (0,)))


def test_packed_shards_are_mapped_shared_and_read_only(packed_keep):
    # Shared read-only mappings of the files: ranks on a node read one copy in the page
    # cache (the pages are the file's, never this process's private memory).
    ds = load("packed", packed_keep)
    for i in range(len(ds.train)):
        bytes(ds.train.record(i).data[:1])
    shards = {os.path.realpath(p) for p in ds.train.shard_files}
    with open("/proc/self/maps") as f:
        modes = {line.split()[-1]: line.split()[1] for line in f
                 if len(line.split()) >= 6 and line.split()[-1] in shards}
    assert set(modes) == shards
    assert all(mode == "r--s" for mode in modes.values()), modes


def test_decode_threads_do_not_change_the_batches(folder):
    ds = load("imagefolder", folder)
    inline = all_batches(ds, augment=True, workers=0)
    assert_same_batches(inline, all_batches(ds, augment=True, workers=3, prefetch=1))


def test_ranks_decode_their_shards_of_the_same_global_batch(folder):
    ds = load("imagefolder", folder)
    whole = data.Loader(ds, 8, augment=True, seed=1)
    halves = [data.Loader(ds, 8, rank=r, world=2, augment=True, seed=1) for r in (0, 1)]
    for (x, y), *parts in zip(whole.batches(3), *(h.batches(3) for h in halves)):
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    resumed = [x.copy() for x, _ in whole.batches(3, start=2)]
    np.testing.assert_array_equal(resumed[0], [x for x, _ in whole.batches(3)][2])


def test_packing_resizes_the_shorter_side_and_keeps_small_images(folder, tmp_path):
    dest = tmp_path / "p48"
    packer.pack(str(folder), str(dest), size=48, stream=open(os.devnull, "w"))
    ds = load("packed", dest)
    src = load("imagefolder", folder)
    for i in range(len(src.train)):
        o = Opened(src.train.record(i))
        p = Opened(ds.train.record(i))
        if min(o.height, o.width) > 48:
            assert min(p.height, p.width) == 48, src.train.path(i)
            assert p.record.encoding == "jpeg"
        else:
            assert (p.height, p.width) == (o.height, o.width)
    assert len(all_batches(ds, epochs=(0,))) == len(src.y_train) // 8


@pytest.mark.parametrize("shape", [(40, 3, 32, 32), (40, 28, 28)])
def test_packed_array_dataset_is_augmented_like_the_array(tmp_path, rng, shape):
    x = rng.integers(0, 256, shape, dtype=np.uint8)
    y = rng.integers(0, 5, 40)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x[:8], y_test=y[:8])
    packer.pack(str(tmp_path / "d.npz"), str(tmp_path / "p"), dataset="npz",
                stream=open(os.devnull, "w"))
    arrays, stored = data.load("npz", str(tmp_path / "d.npz")), data.load("packed", str(tmp_path / "p"))
    assert stored.input_shape == arrays.input_shape and stored.mean == arrays.mean
    assert not stored.augment_by_default      # as npz: only with --augment
    assert_same_batches(all_batches(arrays, augment=True), all_batches(stored, augment=True))


# Packs with the third shard's write killed half-way (SIGKILL: nothing cleans up).
_KILLED_PACK = """
import os, signal, sys
from dynar import atomic_write
from dynar.data import packer
original, shards = atomic_write.replace_atomically, []
def dying(target, fill):
    if target.endswith(".shard"):
        shards.append(target)
        if len(shards) == 3:
            def half(tmp):
                with open(tmp, "xb") as f:
                    f.write(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
            return original(target, half)
    return original(target, fill)
atomic_write.replace_atomically = dying
packer.pack(sys.argv[1], sys.argv[2], size=None, shard_mb=0.1)
"""


def test_packing_interrupted_and_rerun_completes(folder, tmp_path, packed_keep):
    dest = tmp_path / "p"
    killed = subprocess.run([sys.executable, "-c", _KILLED_PACK, str(folder), str(dest)],
                            cwd=ROOT, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL
    assert len(list((dest / ".pack").glob("train-*.index.npy"))) == 2
    assert list(dest.glob(".train-00002.shard.*.tmp")), "the killed write left its temporary"
    with pytest.raises(data.DataError, match="interrupted"):
        data.load("packed", str(dest))
    cmd = [sys.executable, "-m", "dynar.data", "pack", str(folder), str(dest), "--size", "keep",
           "--shard-mb", "0.1"]
    refused = subprocess.run(cmd[:-3] + ["64", "--shard-mb", "0.1"], cwd=ROOT,
                             capture_output=True, text=True)
    assert refused.returncode == 1 and "other settings (size)" in refused.stderr, refused.stderr
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stderr
    assert sorted(os.listdir(dest)) == sorted(os.listdir(packed_keep))
    for name in os.listdir(packed_keep):
        if name != "meta.json":
            assert (dest / name).read_bytes() == (packed_keep / name).read_bytes(), name
    assert_same_batches(all_batches(load("packed", dest)), all_batches(load("packed", packed_keep)))


# --------------------------------------------------------------- a packed set that is wrong

def _copy(packed_keep, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(packed_keep, dest)
    return dest


def _rewrite_index(dest, change):
    path = dest / "train.index.npy"
    index = np.load(path)
    change(index)
    np.save(path, index)
    meta = json.loads((dest / "meta.json").read_text())
    meta["splits"]["train"]["index_sha256"] = data.packed.file_sha256(path)
    (dest / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, needle", [
    (lambda d: open(d / "train-00001.shard", "r+b").truncate(100), "bytes, meta.json says"),
    (lambda d: os.remove(d / "train-00002.shard"), "missing shard"),
    (lambda d: np.save(d / "train.index.npy", np.load(d / "train.index.npy")[:-1]), "SHA-256"),
    (lambda d: _rewrite_index(d, lambda ix: ix["offset"].__setitem__(3, ix["offset"][3] + 1)),
     "disagrees with its shards"),
    (lambda d: _rewrite_index(d, lambda ix: ix["length"].__setitem__(-1, ix["length"][-1] - 1)),
     "disagrees with its shards"),
    (lambda d: _rewrite_index(d, lambda ix: ix["label"].__setitem__(0, 99)), "labels outside"),
    (lambda d: (d / "meta.json").write_text("{"), "unreadable"),
])
def test_a_packed_set_whose_index_disagrees_with_its_shards_is_refused(packed_keep, tmp_path,
                                                                        damage, needle):
    dest = _copy(packed_keep, tmp_path)
    damage(dest)
    with pytest.raises(data.DataError, match=needle) as info:
        data.load("packed", str(dest))
    assert "\n" not in str(info.value) and str(dest) in str(info.value)


def test_a_damaged_record_is_named_when_read(packed_keep, tmp_path):
    dest = _copy(packed_keep, tmp_path)
    with open(dest / "train-00000.shard", "r+b") as f:
        f.seek(500)
        f.write(b"\x00" * 16)
    ds = load("packed", dest)
    with pytest.raises(data.DataError, match=r"train-00000.shard record 0 .*CRC-32"):
        all_batches(ds, augment=False, shuffle=False)
    out = subprocess.run([sys.executable, "-m", "dynar.data", "verify", str(dest)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1 and "CRC-32" in out.stderr


# ------------------------------------------------------------------------ transforms

def torch_uniform(lo, hi, u):
    return lo + (hi - lo) * u           # torch.empty(1).uniform_(lo, hi) with its draw u


def reference_random_resized_crop(height, width, scale_u, ratio_u, top_u, left_u):
    """torchvision.transforms.RandomResizedCrop.get_params (scale (0.08, 1), ratio (3/4,
    4/3)), restated with its random draws passed in."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for attempt in range(10):
        target_area = area * torch_uniform(0.08, 1.0, scale_u[attempt])
        aspect_ratio = math.exp(torch_uniform(log_ratio[0], log_ratio[1], ratio_u[attempt]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = math.floor(top_u * (height - h + 1))
            j = math.floor(left_u * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(3 / 4, 4 / 3):
        w = width
        h = int(round(w / min(3 / 4, 4 / 3)))
    elif in_ratio > max(3 / 4, 4 / 3):
        h = height
        w = int(round(h * max(3 / 4, 4 / 3)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def reference_train(image, box, size, flip, resample=Image.BILINEAR):
    """F.resized_crop(img, i, j, h, w, size, BILINEAR) + hflip + ToTensor + Normalize."""
    i, j, h, w = box
    out = image.crop((j, i, j + w, i + h)).resize((size, size), resample)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return _to_tensor_normalized(out)


def reference_eval(image, size, resample=Image.BILINEAR):
    """Resize(round(size / 0.875)) + CenterCrop(size) + ToTensor + Normalize."""
    short = int(round(size / 0.875))
    w, h = image.size
    oh, ow = (int(short * h / w), short) if w <= h else (short, int(short * w / h))
    out = image.resize((ow, oh), resample)
    top, left = int(round((oh - size) / 2.0)), int(round((ow - size) / 2.0))
    return _to_tensor_normalized(out.crop((left, top, left + size, top + size)))


def _to_tensor_normalized(image):
    x = np.asarray(image.convert("RGB"), np.float32).transpose(2, 0, 1) / np.float32(255)
    return (x - MEAN[:, None, None].astype(np.float32)) / STD[:, None, None].astype(np.float32)


def levels(x, expected):
    """|x - expected| in pixel levels (0-255) of the normalised inputs."""
    return np.abs(x - expected) * STD[:, None, None] * 255


def assert_within_interpolation_error(x, reference, path):
    """A DCT-scaled decode changes pixels by interpolation error: no more, on average, than
    Lanczos instead of bilinear resampling changes the reference."""
    yardstick = levels(reference(Image.LANCZOS), reference(Image.BILINEAR)).mean()
    error = levels(x, reference(Image.BILINEAR)).mean()
    assert error <= max(yardstick, 1.0), (path, error, yardstick)


def test_random_resized_crop_boxes_are_torchvisions_exactly():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        height, width = (int(v) for v in rng.integers(1, 700, 2))
        if rng.random() < 0.2:           # extreme aspect ratios take the fall-back
            width = int(rng.integers(1, 12)) * height
        draws = rng.random(10), rng.random(10), rng.random(), rng.random()
        assert transforms.random_resized_crop_box(height, width, *draws) == \
            reference_random_resized_crop(height, width, *draws), (height, width)


@pytest.mark.parametrize("size", [32, 224])
def test_transformed_batches_agree_with_the_reference(folder, size):
    ds = load("imagefolder", folder, size)
    loader = data.Loader(ds, 8, augment=True, seed=9, workers=2)
    scaled = 0
    for step, (x, _) in enumerate(loader.batches(0)):
        draws = loader.transform.draws(9, 0, step, 8)
        for k, i in enumerate(loader.order(0)[step * 8:(step + 1) * 8]):
            path = ds.train.path(int(i))
            image = Image.open(path)
            scale_u, ratio_u, top_u, left_u, flip = (d[k] for d in draws)
            box = reference_random_resized_crop(image.height, image.width, scale_u, ratio_u,
                                                top_u, left_u)
            crop = loader.transform.crop(image.height, image.width, draws, k)
            assert (crop.y0, crop.x0, crop.y1 - crop.y0, crop.x1 - crop.x0) == box
            rgb = image.convert("RGB")
            reference = lambda f: reference_train(rgb, box, size, flip, f)   # noqa: E731
            if min(box[2], box[3]) >= 2 * size and path.endswith(".jpg") and "cmyk" not in path:
                scaled += 1              # decoded at 1/2 or less
                assert_within_interpolation_error(x[k], reference, path)
            else:
                assert levels(x[k], reference(Image.BILINEAR)).max() < 1e-3, path
    assert scaled >= 1      # the large photograph's DCT-scaled path ran
    test = data.Loader(ds, 8, split="test", workers=1)
    for step, (x, _) in enumerate(test.batches(0)):
        for k in range(len(x)):
            path = ds.test.path(step * 8 + k)
            image = Image.open(path).convert("RGB")
            reference = lambda f: reference_eval(image, size, f)   # noqa: E731
            if min(image.size) >= 2 * int(round(size / 0.875)) and path.endswith(".jpg"):
                assert_within_interpolation_error(x[k], reference, path)
            else:
                assert levels(x[k], reference(Image.BILINEAR)).max() < 1e-3, path


def test_edge_case_images_decode_as_pillow_converts_them(folder):
    names = photos.edge_cases(folder / "train" / "class_00", photos.photographs()[0])
    for name in names:
        path = folder / "train" / "class_00" / name
        pixels = Opened(Record(str(path), path.read_bytes())).pixels()
        expected = np.asarray(Image.open(path).convert("RGB"))
        assert pixels.dtype == np.uint8 and pixels.shape == expected.shape, name
        np.testing.assert_array_equal(pixels, expected, err_msg=name)
    # EXIF orientation is ignored, as torchvision ignores it: stored 160 wide, 120 high.
    assert Opened(Record("x", (folder / "train" / "class_00" / "exif_rotated.jpg")
                         .read_bytes())).pixels().shape == (120, 160, 3)


# --------------------------------------------------------------------------- bad inputs

@pytest.fixture
def bad_folder(tmp_path, photo):
    photos.build_folder(tmp_path, classes=2, train_per_class=4, val_per_class=1, png_every=0)
    return tmp_path


@pytest.mark.parametrize("bad", ["truncated.jpg", "corrupt.jpg", "text.jpg", "empty.png",
                                 "truncated.png"])
def test_each_bad_file_gives_a_one_line_error_naming_it(bad_folder, photo, tmp_path, bad):
    scratch = tmp_path / "bad"
    photos.bad_files(scratch, photo)
    os.replace(scratch / bad, bad_folder / "train" / "class_01" / bad)
    ds = load("imagefolder", bad_folder)
    with pytest.raises(data.DataError) as info:
        all_batches(ds, augment=True, shuffle=False, drop_last=False, workers=2)
    message = str(info.value)
    assert message.startswith(str(bad_folder / "train" / "class_01" / bad) + ": ")
    assert "\n" not in message


# pytest's own warning capture sets aside the filter decode.py installs for Pillow's notes.
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP"])
def test_damaged_files_decode_or_raise_a_data_error_naming_them(photo, fmt):
    buffer = io.BytesIO()
    Image.fromarray(photo[:48, :64]).save(buffer, fmt)
    blob = buffer.getvalue()
    rng = np.random.default_rng(len(fmt))
    for _ in range(150):
        damaged = bytearray(blob)
        for _ in range(int(rng.integers(1, 8))):
            damaged[int(rng.integers(0, len(damaged)))] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            damaged = damaged[:int(rng.integers(1, len(damaged)))]
        try:
            pixels = Opened(Record("/data/x.img", bytes(damaged))).pixels()
            assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        except data.DataError as e:
            assert str(e).startswith("/data/x.img: ") and "\n" not in str(e)


def test_cli_names_the_bad_file_and_skip_bad_images_counts_it(bad_folder, photo, tmp_path):
    photos.bad_files(bad_folder / "train" / "class_01", photo)
    args = ["--model", "alexnet", "--variant", "cifar", "--dropout", "0", "--dataset",
            "imagefolder", "--data-dir", str(bad_folder), "--batch-size", "13", "--epochs", "1",
            "--threads", "1"]
    out = subprocess.run([sys.executable, "-m", "dynar.train", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad_folder / "train" / "class_01") in lines[0], out.stderr
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "-m", "dynar.train", *args, "--skip-bad-images",
                          "--log", str(log)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    bad = [r for r in records if r["event"] == "bad_images"]
    assert bad and bad[0]["count"] == 5 and len(bad[0]["rank0_files"]) == 5
    assert "skipped 5 unreadable image(s)" in out.stdout


def test_empty_class_and_mismatched_classes_are_named(bad_folder):
    (bad_folder / "train" / "class_02").mkdir()
    (bad_folder / "train" / "class_02" / "notes.txt").write_text("no images here")
    with pytest.raises(data.DataError, match=r"without images: class_02 "):
        data.load("imagefolder", str(bad_folder))
    shutil.rmtree(bad_folder / "train" / "class_02")
    (bad_folder / "val" / "class_01").rename(bad_folder / "val" / "class_07")
    with pytest.raises(data.DataError, match=r"val: classes differ .*not in train: class_07; "
                                             r"missing: class_01"):
        data.load("imagefolder", str(bad_folder))
    with pytest.raises(data.DataError, match="train: missing"):
        data.load("imagefolder", str(bad_folder / "val"))


# ----------------------------------------------------------------------------- training

def test_resume_mid_epoch_from_an_image_folder_is_bitwise(folder, tmp_path):
    common = dict(model="alexnet", variant="cifar", dropout=0.0, dataset="imagefolder",
                  data_dir=str(folder), batch_size=8, epochs=2, eval_every=0, threads=1)
    train(TrainConfig(checkpoint_dir=str(tmp_path / "a"), **common))
    train(TrainConfig(checkpoint_dir=str(tmp_path / "b"), max_steps=2, **common))
    assert checkpoint.load(tmp_path / "b" / "last.ckpt")["step_in_epoch"] == 2
    train(TrainConfig(checkpoint_dir=str(tmp_path / "b"), resume=str(tmp_path / "b"), **common))
    a, b = (checkpoint.load(tmp_path / d / "last.ckpt") for d in "ab")
    assert a["global_step"] == b["global_step"] == 8
    for name in a["model"]:
        assert np.array_equal(a["model"][name], b["model"][name]), name
    assert a["config"]["classes"] == ["class_00", "class_01", "class_02", "class_03"]


def test_resume_refuses_other_classes(folder, tmp_path):
    common = dict(model="alexnet", variant="cifar", dropout=0.0, dataset="imagefolder",
                  batch_size=8, max_steps=1, eval_every=0, threads=1)
    train(TrainConfig(data_dir=str(folder), checkpoint_dir=str(tmp_path / "a"), **common))
    other = tmp_path / "other"
    photos.build_folder(other, classes=4, train_per_class=2, val_per_class=1)
    (other / "train" / "class_03").rename(other / "train" / "zebra")
    (other / "val" / "class_03").rename(other / "val" / "zebra")
    with pytest.raises(checkpoint.CheckpointError, match="other classes.*zebra"):
        train(TrainConfig(data_dir=str(other), resume=str(tmp_path / "a"), **common))


@pytest.mark.slow   # ~10 s on 2 cores: ResNet-18 at 224x224
def test_resnet18_imagenet_trains_and_evaluates_on_photographs(folder, tmp_path):
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "-m", "dynar.train", "--model", "resnet18",
                          "--variant", "imagenet", "--dataset", "imagefolder", "--data-dir",
                          str(folder), "--batch-size", "8", "--max-steps", "2", "--epochs", "1",
                          "--log", str(log)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "RandomResizedCrop(224)+flip" in out.stdout and "Resize(256)+CenterCrop(224)" in out.stdout
    # No --threads, no --data-workers: compute takes every core, decode the one default thread.
    assert "1 decode thread(s) per rank" in out.stdout
    assert "(default: --data-workers N to change)" in out.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    summary = records[-1]
    assert summary["synthetic"] is False and summary["dataset"] == "imagefolder"
    assert summary["final_accuracy"] is not None and summary["steps"] == 2
    data_record, = [r for r in records if r.get("event") == "data"]
    assert len(data_record["classes"]) == 4


@pytest.mark.parametrize("cores, compute, decode", [(8, 2, 6), (4, 4, 1), (2, 2, 1),
                                                     (1, 1, 1), (2, 1, 1)])
def test_decode_threads_default_to_the_cores_compute_leaves_and_at_least_one(cores, compute,
                                                                             decode):
    assert data.pipeline.default_workers(cores, compute) == decode


def test_cifar100_python_archive(tmp_path, rng):
    import pickle
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 30), ("test", 10)):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"fine_labels": list(rng.integers(0, 100, n)), b"coarse_labels": [0] * n}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    ds = data.load("cifar100", str(tmp_path))
    assert ds.num_classes == 100 and ds.input_shape == (3, 32, 32) and len(ds.y_test) == 10
    assert data.Loader(ds, 10, augment=True).steps == 3
    (folder / "test").write_bytes(b"garbage")
    with pytest.raises(data.DataError, match="test: not a readable CIFAR-100"):
        data.load("cifar100", str(tmp_path))


def test_npz_can_be_augmented(tmp_path, rng):
    x = rng.integers(0, 256, (24, 3, 32, 32), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=rng.integers(0, 3, 24))
    done = train(TrainConfig(model="alexnet", variant="cifar", dataset="npz", augment=True,
                             data_dir=str(tmp_path / "d.npz"), batch_size=8, max_steps=2,
                             eval_every=0, threads=1))
    assert done.summary["steps"] == 2
