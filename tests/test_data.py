"""dynar.data: readers on files written here in the real formats, the loader's sharding and
augmentation, and the embedded mnist-sample."""
import gzip
import os
import pickle
import shutil

import numpy as np
import pytest

from dynar import data
from dynar.data import augment, cifar, sample
from dynar.data.augment import PAD


def assert_data_error(path, func, *args, **kwargs):
    """func raises DataError with a one-line message naming path; the message is returned."""
    with pytest.raises(data.DataError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- MNIST / Fashion-MNIST IDX

def idx_bytes(array, magic=None):
    array = np.ascontiguousarray(array, np.uint8)
    magic = magic if magic is not None else bytes([0, 0, 0x08, array.ndim])
    return magic + np.asarray(array.shape, ">u4").tobytes() + array.tobytes()


def write_mnist(folder, rng, n_train=20, n_test=10, gz=False):
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train": (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                        rng.integers(0, 10, n_train)),
              "test": (rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                       rng.integers(0, 10, n_test))}
    for prefix, split in (("train", "train"), ("t10k", "test")):
        images, labels = arrays[split]
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            blob = idx_bytes(array)
            if gz:
                (folder / (stem + ".gz")).write_bytes(gzip.compress(blob))
            else:
                (folder / stem).write_bytes(blob)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_raw_and_gz(tmp_path, rng, gz):
    arrays = write_mnist(tmp_path, rng, gz=gz)
    ds = data.load("mnist", data_dir=str(tmp_path))
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10 and ds.mean == (0.1307,)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train"][0])
    np.testing.assert_array_equal(ds.y_train, arrays["train"][1])
    np.testing.assert_array_equal(ds.x_test[:, 0], arrays["test"][0])
    np.testing.assert_array_equal(ds.y_test, arrays["test"][1])


def test_fashion_mnist_found_in_subdirectory(tmp_path, rng):
    arrays = write_mnist(tmp_path / "fashion-mnist", rng, gz=True)
    ds = data.load("fashion-mnist", data_dir=str(tmp_path))
    assert ds.name == "fashion-mnist" and ds.mean == (0.2860,)
    np.testing.assert_array_equal(ds.y_test, arrays["test"][1])


def test_mnist_missing_everything_names_the_files(tmp_path):
    message = assert_data_error(tmp_path, data.load, "mnist", data_dir=str(tmp_path))
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        assert stem in message
    assert "--data-dir" in message


def test_mnist_missing_one_file(tmp_path, rng):
    write_mnist(tmp_path, rng)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    assert_data_error(tmp_path / "t10k-labels-idx1-ubyte", data.load, "mnist", str(tmp_path))


def test_mnist_wrong_magic(tmp_path, rng):
    write_mnist(tmp_path, rng)
    path = tmp_path / "train-images-idx3-ubyte"
    blob = bytearray(path.read_bytes())
    blob[3] = 1  # labels' magic on an image file
    path.write_bytes(bytes(blob))
    assert "magic" in assert_data_error(path, data.load, "mnist", str(tmp_path))


def test_mnist_truncated_raw(tmp_path, rng):
    write_mnist(tmp_path, rng)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    assert "truncated" in assert_data_error(path, data.load, "mnist", str(tmp_path))
    path.write_bytes(b"\0\0\x08")
    assert "truncated" in assert_data_error(path, data.load, "mnist", str(tmp_path))


def test_mnist_truncated_and_corrupt_gz(tmp_path, rng):
    write_mnist(tmp_path, rng, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    assert_data_error(path, data.load, "mnist", str(tmp_path))
    path.write_bytes(b"this is not gzip at all")
    assert_data_error(path, data.load, "mnist", str(tmp_path))


def test_mnist_mismatched_counts_and_bad_labels(tmp_path, rng):
    write_mnist(tmp_path, rng)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.zeros(19)))
    assert "19 labels" in assert_data_error(labels, data.load, "mnist", str(tmp_path))
    labels.write_bytes(idx_bytes(np.full(20, 10)))
    assert_data_error(labels, data.load, "mnist", str(tmp_path))


# ---------------------------------------------------------------- CIFAR-10

def cifar_arrays(rng, n):
    return [(rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n))
            for _ in range(6)]  # 5 training batches, then the test batch


def write_cifar_bin(folder, batches):
    folder.mkdir(parents=True, exist_ok=True)
    for stem, (images, labels) in zip(cifar.TRAIN + [cifar.TEST], batches):
        records = np.concatenate([labels[:, None].astype(np.uint8), images], axis=1)
        (folder / (stem + ".bin")).write_bytes(records.tobytes())


def write_cifar_py(folder, batches):
    folder.mkdir(parents=True, exist_ok=True)
    for stem, (images, labels) in zip(cifar.TRAIN + [cifar.TEST], batches):
        batch = {b"batch_label": stem.encode(), b"data": images, b"labels": labels.tolist(),
                 b"filenames": [b"x.png"] * len(labels)}
        with open(folder / stem, "wb") as f:
            pickle.dump(batch, f, protocol=2)


def check_cifar(ds, batches):
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10 and ds.augmentable
    assert ds.x_train.dtype == np.uint8 and ds.x_train.flags.c_contiguous
    images = np.concatenate([b[0] for b in batches[:5]]).reshape(-1, 3, 32, 32)
    np.testing.assert_array_equal(ds.x_train, images)
    np.testing.assert_array_equal(ds.y_train, np.concatenate([b[1] for b in batches[:5]]))
    np.testing.assert_array_equal(ds.x_test, batches[5][0].reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(ds.y_test, batches[5][1])


@pytest.mark.parametrize("layout", ["bin", "py"])
def test_cifar_layouts(tmp_path, rng, layout):
    batches = cifar_arrays(rng, 4)
    folder = tmp_path / f"cifar-10-batches-{layout}"
    (write_cifar_bin if layout == "bin" else write_cifar_py)(folder, batches)
    check_cifar(data.load("cifar10", data_dir=str(tmp_path)), batches)
    check_cifar(data.load("cifar10", data_dir=str(folder)), batches)  # the directory itself


def test_cifar_missing(tmp_path, rng):
    message = assert_data_error(tmp_path, data.load, "cifar10", str(tmp_path))
    assert "cifar-10-batches-bin" in message and "--data-dir" in message
    write_cifar_bin(tmp_path, cifar_arrays(rng, 2))
    os.remove(tmp_path / "test_batch.bin")
    assert_data_error(tmp_path / "test_batch.bin", data.load, "cifar10", str(tmp_path))


def test_cifar_binary_truncated_and_bad_label(tmp_path, rng):
    write_cifar_bin(tmp_path, cifar_arrays(rng, 3))
    path = tmp_path / "data_batch_3.bin"
    blob = path.read_bytes()
    path.write_bytes(blob[:-1])
    assert "3073" in assert_data_error(path, data.load, "cifar10", str(tmp_path))
    path.write_bytes(bytes([10]) + blob[1:])
    assert_data_error(path, data.load, "cifar10", str(tmp_path))


def test_cifar_pickle_corrupt_and_hostile(tmp_path, rng):
    write_cifar_py(tmp_path, cifar_arrays(rng, 3))
    path = tmp_path / "data_batch_2"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    assert_data_error(path, data.load, "cifar10", str(tmp_path))
    # A pickle that would call os.system when loaded with plain pickle.load.
    path.write_bytes(b"cos\nsystem\n(S'echo hacked'\ntR.")
    assert "os.system" in assert_data_error(path, data.load, "cifar10", str(tmp_path))
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((3, 100), np.uint8), b"labels": [0, 1, 2]}, f)
    assert_data_error(path, data.load, "cifar10", str(tmp_path))


# ---------------------------------------------------------------- npz

def test_npz_layouts_agree(tmp_path, rng):
    x = rng.integers(0, 256, (50, 3, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 4, 50)
    np.savez(tmp_path / "nchw.npz", x=x, y=y)
    np.savez(tmp_path / "nhwc.npz", x=x.transpose(0, 2, 3, 1), y=y)
    a = data.load("npz", data_dir=str(tmp_path / "nchw.npz"), seed=3)
    b = data.load("npz", data_dir=str(tmp_path / "nhwc.npz"), seed=3)
    assert a.input_shape == b.input_shape == (3, 8, 8) and a.num_classes == 4
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert len(a.y_test) == 5 and len(a.y_train) == 45
    # the held-out split is a seeded partition of the samples
    seen = np.concatenate([a.x_train, a.x_test]).reshape(50, -1)
    assert sorted(map(bytes, seen)) == sorted(map(bytes, x.reshape(50, -1)))
    c = data.load("npz", data_dir=str(tmp_path / "nchw.npz"), seed=4)
    assert not np.array_equal(a.y_test, c.y_test) or not np.array_equal(a.x_test, c.x_test)
    np.testing.assert_allclose(a.mean, a.x_train.mean(axis=(0, 2, 3)) / 255)  # training split only
    np.testing.assert_allclose(a.std, a.x_train.std(axis=(0, 2, 3)) / 255)


def test_npz_float_with_test_split_and_dir(tmp_path, rng):
    x = rng.normal(5.0, 2.0, (40, 1, 6, 6))
    x_test = rng.normal(5.0, 2.0, (7, 6, 6))  # (N, H, W): single channel
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(40) % 3, x_test=x_test, y_test=np.zeros(7, np.int32))
    ds = data.load("npz", data_dir=str(tmp_path), num_classes=5)
    assert ds.x_train.dtype == np.float32 and ds.num_classes == 5 and ds.scale == 1.0
    np.testing.assert_allclose(ds.x_test[:, 0], x_test.astype(np.float32))
    np.testing.assert_allclose(ds.mean[0], x.mean(), rtol=1e-6)
    np.testing.assert_allclose(ds.std[0], x.std(), rtol=1e-6)
    loader = data.Loader(ds, 40)
    (xb, _), = loader.batches(0)
    assert abs(xb.mean()) < 1e-5 and abs(xb.std() - 1) < 1e-5


@pytest.mark.parametrize("arrays, words", [
    (dict(x=np.zeros((4, 3, 5, 3), np.uint8), y=np.zeros(4, int)), "NCHW or NHWC"),
    (dict(x=np.zeros((4, 2, 5, 5), np.uint8), y=np.zeros(4, int)), "NCHW or NHWC"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8)), "'y'"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(3, int)), "shape (4,)"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(4)), "integers"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(4, int), x_test=np.zeros((2, 1, 5, 5))), "together"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(4, int), x_test=np.zeros((2, 1, 4, 4)),
          y_test=np.zeros(2, int)), "x_test"),
    (dict(x=np.full((4, 1, 5, 5), np.nan), y=np.zeros(4, int)), "NaN"),
    (dict(x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(4, int),
          x_test=np.full((2, 1, 5, 5), 0.5), y_test=np.zeros(2, int)), "both as floats"),
])
def test_npz_bad_contents(tmp_path, arrays, words):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    assert words in assert_data_error(path, data.load, "npz", str(path))


def test_npz_bad_files(tmp_path):
    assert_data_error(tmp_path / "none.npz", data.load, "npz", str(tmp_path / "none.npz"))
    assert_data_error(tmp_path, data.load, "npz", str(tmp_path))  # no .npz in the directory
    path = tmp_path / "a.npz"
    np.savez(path, x=np.zeros((10, 1, 4, 4), np.uint8), y=np.zeros(10, int))
    path.write_bytes(path.read_bytes()[:-60])
    assert_data_error(path, data.load, "npz", str(path))
    path.write_bytes(b"garbage" * 10)
    assert_data_error(path, data.load, "npz", str(path))
    np.save(tmp_path / "b.npy", np.zeros(3))
    os.replace(tmp_path / "b.npy", path)
    assert_data_error(path, data.load, "npz", str(path))
    with pytest.raises(data.DataError, match="--data-dir"):
        data.load("npz")


# ---------------------------------------------------------------- mnist-sample, synthetic, registry

def test_mnist_sample():
    ds = data.load("mnist-sample")
    assert (len(ds.y_train), len(ds.y_test)) == (4000, 1000)
    assert ds.input_shape == (1, 28, 28) and ds.x_train.dtype == np.uint8 and not ds.synthetic
    assert ds.y_train.min() == 0 and ds.y_train.max() == 9
    np.testing.assert_array_equal(np.bincount(ds.y_test), [100] * 10)
    # real digits: mostly black background, white strokes, mean intensity near MNIST's 0.13
    assert ds.x_train.max() == 255 and np.mean(ds.x_train == 0) > 0.7
    assert 0.10 < ds.x_train.mean() / 255 < 0.16
    again = data.load("mnist-sample", seed=123)  # the split is fixed, whatever the seed
    np.testing.assert_array_equal(ds.x_test, again.x_test)
    np.testing.assert_array_equal(ds.y_train, again.y_train)
    train = set(map(bytes, ds.x_train.reshape(4000, -1)))
    assert not train & set(map(bytes, ds.x_test.reshape(1000, -1)))


def test_mnist_sample_is_package_data_and_small():
    files = sorted(os.listdir(sample.FOLDER))
    assert files == ["README.md", sample.IMAGES, sample.LABELS]
    assert sum(os.path.getsize(os.path.join(sample.FOLDER, f)) for f in files) < 2 << 20
    assert "LeCun" in open(os.path.join(sample.FOLDER, "README.md")).read()


def test_mnist_sample_with_damaged_files_names_them(tmp_path):
    for name in (sample.IMAGES, sample.LABELS):
        shutil.copy(os.path.join(sample.FOLDER, name), tmp_path / name)
    (tmp_path / sample.LABELS).write_bytes(gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 2, 3, 4])))
    assert_data_error(tmp_path, sample.load, str(tmp_path))    # 2 labels for 5,000 images
    (tmp_path / sample.LABELS).write_bytes(gzip.compress(b"\0\0\x08\x01")[:-4])
    assert_data_error(tmp_path / sample.LABELS, sample.load, str(tmp_path))
    os.remove(tmp_path / sample.IMAGES)
    assert_data_error(tmp_path / sample.IMAGES, sample.load, str(tmp_path))


def test_synthetic():
    ds = data.load("synthetic", model_input_shape=(3, 16, 12), num_classes=7, seed=5)
    assert ds.synthetic and ds.name == "synthetic" and "synthetic" in repr(ds)
    assert ds.input_shape == (3, 16, 12) and ds.num_classes == 7 and ds.x_train.dtype == np.float32
    assert ds.y_train.max() == 6 and ds.y_train.min() == 0
    assert abs(ds.x_train.mean()) < 0.01 and abs(ds.x_train.std() - 1) < 0.01
    np.testing.assert_array_equal(ds.x_train, data.load("synthetic", seed=5, num_classes=7,
                                                        model_input_shape=(3, 16, 12)).x_train)
    assert not np.array_equal(ds.y_train, data.load("synthetic", seed=6, num_classes=7,
                                                    model_input_shape=(3, 16, 12)).y_train)


def test_registry_checks_model(tmp_path, rng):
    write_mnist(tmp_path, rng)
    with pytest.raises(data.DataError, match="1x28x28 but the model expects 3x32x32"):
        data.load("mnist", str(tmp_path), model_input_shape=(3, 32, 32))
    with pytest.raises(data.DataError, match="2 outputs"):
        data.load("mnist", str(tmp_path), num_classes=2)
    assert data.load("mnist", str(tmp_path), model_input_shape=(1, 28, 28), num_classes=10)
    with pytest.raises(data.DataError, match="unknown dataset"):
        data.load("imagenet")


# ---------------------------------------------------------------- loader

def indexed_dataset(n=100, augmentable=False, shape=(3, 6, 6)):
    """uint8 dataset whose sample i has every pixel equal to i, so batches reveal indices."""
    x = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None], (n,) + shape).copy()
    y = np.arange(n, dtype=np.int64) % 10
    return data.Dataset("indexed", x, y, x[: n // 2].copy(), y[: n // 2].copy(), 10,
                        mean=(0.1, 0.2, 0.3)[: shape[0]], std=(0.5, 0.25, 0.125)[: shape[0]],
                        augmentable=augmentable)


def collect(loader, epoch):
    return [(x.copy(), y.copy()) for x, y in loader.batches(epoch)]


def test_loader_normalises_and_permutes():
    ds = indexed_dataset()
    loader = data.Loader(ds, 16, seed=1)
    assert loader.steps == len(loader) == 6  # 100 // 16: the last 4 samples are dropped
    batches = collect(loader, 0)
    x, y = batches[0]
    assert x.dtype == np.float32 and x.flags.c_contiguous and y.dtype == np.int64
    idx = np.rint((x[:, 0, 0, 0] * 0.5 + 0.1) * 255).astype(int)  # undo the normalisation
    expected = ((idx[:, None, None, None] / 255 - np.array([0.1, 0.2, 0.3])[:, None, None])
                / np.array([0.5, 0.25, 0.125])[:, None, None]) * np.ones((1, 6, 6))
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, idx % 10)
    seen = np.concatenate([np.rint((b[0][:, 0, 0, 0] * 0.5 + 0.1) * 255) for b in batches])
    np.testing.assert_array_equal(seen, loader.order(0)[:96])
    assert len(set(seen)) == 96
    assert not np.array_equal(loader.order(0), loader.order(1))
    np.testing.assert_array_equal(loader.order(1), data.Loader(ds, 16, seed=1).order(1))
    assert not np.array_equal(loader.order(1), data.Loader(ds, 16, seed=2).order(1))


@pytest.mark.parametrize("augment", [False, True])
def test_shards_union_is_global_batch(augment):
    ds = indexed_dataset(augmentable=True)
    reference = collect(data.Loader(ds, 16, augment=augment, seed=7), 3)
    for world in (1, 2, 4):
        per_rank = [collect(data.Loader(ds, 16, rank=r, world=world, augment=augment, seed=7), 3)
                    for r in range(world)]
        assert all(len(batches) == len(reference) for batches in per_rank)
        for step, (x, y) in enumerate(reference):
            assert all(batches[step][0].shape[0] == 16 // world for batches in per_rank)
            np.testing.assert_array_equal(np.concatenate([b[step][0] for b in per_rank]), x)
            np.testing.assert_array_equal(np.concatenate([b[step][1] for b in per_rank]), y)


@pytest.mark.parametrize("augment", [False, True])
def test_micro_batches_hold_the_same_samples_on_every_rank_count(augment):
    # 4 micro-batches of 4: micro-batch m is samples [4m, 4m + 4) of the global batch on 1,
    # 2 or 4 ranks, each rank's shard its share of every micro-batch in turn.
    ds = indexed_dataset(augmentable=True)
    reference = collect(data.Loader(ds, 16, augment=augment, seed=7), 2)
    for world in (1, 2, 4):
        per_rank = [collect(data.Loader(ds, 16, rank=r, world=world, augment=augment, seed=7,
                                        micro_batches=4), 2) for r in range(world)]
        share = 4 // world
        for step, (x, y) in enumerate(reference):
            for m in range(4):
                got = [b[step][1][m * share:(m + 1) * share] for b in per_rank]
                np.testing.assert_array_equal(np.concatenate(got), y[4 * m:4 * m + 4])
                pixels = [b[step][0][m * share:(m + 1) * share] for b in per_rank]
                np.testing.assert_array_equal(np.concatenate(pixels), x[4 * m:4 * m + 4])
    with pytest.raises(ValueError, match="does not split into 2 rank.* x 3 equal micro"):
        data.Loader(ds, 16, world=2, micro_batches=3)


def test_test_split_covers_every_sample_on_every_rank_count():
    ds = indexed_dataset(n=90)  # 45 test samples: the last global batch of 16 is partial
    for world in (1, 2, 4):
        loaders = [data.Loader(ds, 16, rank=r, world=world, split="test") for r in range(world)]
        assert {loader.steps for loader in loaders} == {3}
        labels = np.concatenate([y for step in zip(*(collect(l, 0) for l in loaders)) for _, y in step])
        np.testing.assert_array_equal(labels, ds.y_test)


def test_loader_rejects_bad_arguments():
    ds = indexed_dataset()
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        data.Loader(ds, 16, world=3)
    with pytest.raises(ValueError, match="rank 2"):
        data.Loader(ds, 16, rank=2, world=2)
    with pytest.raises(ValueError, match="exceeds"):
        data.Loader(ds, 128)
    with pytest.raises(ValueError, match="not defined for indexed"):
        data.Loader(ds, 16, augment=True)


def test_augmentation_matches_reference_and_is_seeded():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 256, (64, 3, 8, 8), dtype=np.uint8)  # no zeros: padding is visible
    ds = data.Dataset("toy", x, np.zeros(64, np.int64), x[:8].copy(), np.zeros(8, np.int64), 10,
                      (0.0,) * 3, (1.0,) * 3, augmentable=True)
    loader = data.Loader(ds, 32, augment=True, seed=11)
    batches = collect(loader, 2)
    order = loader.order(2)
    for step, (xb, _) in enumerate(batches):
        dy, dx, flip = augment.draw(11, 2, step, 32)
        for i in range(32):
            padded = np.pad(x[order[step * 32 + i]], ((0, 0), (PAD, PAD), (PAD, PAD)))
            want = padded[:, dy[i]:dy[i] + 8, dx[i]:dx[i] + 8]
            want = want[:, :, ::-1] if flip[i] else want
            np.testing.assert_allclose(xb[i], want / 255.0, rtol=1e-6)
    # the draws vary (both flips, several offsets) and repeat exactly under the same seed
    dy, dx, flip = augment.draw(11, 2, 0, 32)
    assert flip.any() and not flip.all() and len(set(dy)) > 3 and dy.max() <= 2 * PAD
    np.testing.assert_array_equal(batches[0][0], collect(data.Loader(ds, 32, augment=True, seed=11), 2)[0][0])
    assert not np.array_equal(batches[0][0], collect(loader, 3)[0][0])
