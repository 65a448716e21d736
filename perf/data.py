"""The input pipeline: decode + augment throughput against PyTorch's DataLoader, the
data-wait of ImageNet-size training on 2 ranks, and what 2 ranks reading one packed set
cost in memory.

1. img/s of RandomResizedCrop(224) + flip batches (64 images) from a JPEG folder and from
   its packed copy (shorter side 256), dynar's Loader with W decode threads against
   torch.utils.data.DataLoader with W workers over perf/torch_imagefolder.py (torchvision's
   ImageFolder and transforms restated: torchvision cannot be imported here), W = 1 and 2;
   each measurement a fresh process, frameworks alternated round by round, medians.
2. `mpiexec -n 2 python -m dynar.train` for resnet50 --variant imagenet from the JPEG folder
   and alexnet --variant imagenet from the packed set, at --data-workers 0, 1 and 2: the
   log summary's data_time_fraction (data wait / step time) and step time.
3. 2 ranks train on a raw-pixel packed set for 2 epochs; each rank's /proc/self/smaps_rollup
   (RSS, PSS, USS = private clean + dirty, anonymous) before and after, against the set's
   size.

The folders are cut from the photographs installed packages ship (tests/support/photos.py)
at ImageNet's typical sizes (shorter side 300-500 px); nothing is downloaded.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import harness
from .dist import _env, _mpiexec
from .models import ROOT

BATCH = 64
WORKERS = (1, 2)


def build_sets(root, per_class, classes=8):
    """(folder, packed JPEG copy, packed raw copy) under root, built once."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support import photos

    from dynar.data import packer
    folder = os.path.join(root, "folder")
    if not os.path.exists(os.path.join(folder, "train")):
        photos.build_folder(folder, classes=classes, train_per_class=per_class,
                            val_per_class=max(2, per_class // 8), sizes=(300, 500),
                            png_every=0)
    sets = {"folder": folder}
    for name, encoding in (("packed", "jpeg"), ("packed_raw", "raw")):
        dest = os.path.join(root, name)
        if not os.path.exists(os.path.join(dest, "meta.json")):
            packer.pack(folder, dest, size=256, encoding=encoding, stream=open(os.devnull, "w"))
        sets[name] = dest
    return sets


# -- 1. decode + augment throughput --------------------------------------------------------

def throughput_worker(framework, path, workers, epochs):
    """In a fresh process: img/s of each epoch after the first (warm-up)."""
    times = []
    if framework == "torch":
        import torch
        torch.set_num_threads(1)
        sys.path.insert(0, os.path.join(ROOT))
        from perf import torch_imagefolder
        batches = torch_imagefolder.loader(os.path.join(path, "train"), workers, BATCH)
        count = len(batches) * BATCH
        for _ in range(epochs + 1):
            start = time.perf_counter()
            for x, y in batches:
                pass
            times.append(time.perf_counter() - start)
    else:
        from dynar import data
        ds = data.load(framework, data_dir=path, model_input_shape=(3, 224, 224))
        loader = data.Loader(ds, BATCH, augment=True, workers=workers, seed=0)
        count = loader.steps * BATCH
        for epoch in range(epochs + 1):
            start = time.perf_counter()
            for x, y in loader.batches(epoch):
                pass
            times.append(time.perf_counter() - start)
        loader.close()
    print(json.dumps({"images_per_sec": [count / t for t in times[1:]]}))


def _throughput(sets, quick):
    rounds, epochs = (1, 1) if quick else (5, 2)
    rows, records = [], []
    for workers in WORKERS:
        samples = {k: [] for k in ("torch", "imagefolder", "packed")}
        for _ in range(rounds):
            for name in samples:
                path = sets["packed"] if name == "packed" else sets["folder"]
                out = _python(["-m", "perf.data", "--throughput", name, path, str(workers),
                               str(epochs)])
                samples[name] += json.loads(out)["images_per_sec"]
        med = {k: statistics.median(v) for k, v in samples.items()}
        records.append({"workers": workers, "samples": samples, "median": med})
        rows.append([workers, f"{med['torch']:.0f} ({med['torch'] / workers:.0f})",
                     f"{med['imagefolder']:.0f} ({med['imagefolder'] / workers:.0f})",
                     f"{med['imagefolder'] / med['torch']:.2f}x",
                     f"{med['packed']:.0f} ({med['packed'] / workers:.0f})",
                     f"{med['packed'] / med['torch']:.2f}x"])
    table = harness.format_table(
        ["workers", "PyTorch DataLoader, folder: img/s (per worker)",
         "dynar, folder", "dynar / PyTorch", "dynar, packed (256)", "packed / PyTorch"], rows)
    return table + (f"\n\nRandomResizedCrop(224) + flip + normalise, batches of {BATCH}; "
                    f"medians of {rounds} alternating rounds x {epochs} epochs after one "
                    f"warm-up epoch"), records


# -- 2. data wait while training -----------------------------------------------------------

def _train_run(model, dataset, path, workers, batch, steps):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = _mpiexec(2) + [sys.executable, "-m", "dynar.train", "--model", model, "--variant",
                             "imagenet", "--dataset", dataset, "--data-dir", path,
                             "--batch-size", str(batch), "--max-steps", str(steps),
                             "--eval-every", "0", "--log", log, "--data-workers", str(workers)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                             timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"{model} from {dataset}: {out.stderr.strip()[-2000:]}")
        summary = json.loads(open(log).read().splitlines()[-1])
    return {k: summary[k] for k in ("data_time_fraction", "step_time_s", "data_time_s",
                                    "images_per_sec", "threads", "measured_steps")}


def _data_wait(sets, quick):
    """Each configuration's launches alternate worker counts round by round; the figures
    are medians over the rounds of each launch's summary (itself a median over steps)."""
    rounds = 1 if quick else 2
    runs = [("resnet50", "imagefolder", sets["folder"], 16, 6, (1,) if quick else (0, 1)),
            ("alexnet", "packed", sets["packed"], 64, 6 if quick else 10,
             (1,) if quick else (0, 1, 2))]
    rows, records = [], []
    for model, dataset, path, batch, steps, worker_counts in runs:
        launches = {w: [] for w in worker_counts}
        for _ in range(rounds):
            for workers in worker_counts:
                launches[workers].append(_train_run(model, dataset, path, workers, batch, steps))
        for workers, results in launches.items():
            med = {k: statistics.median(r[k] for r in results)
                   for k in ("data_time_fraction", "step_time_s", "images_per_sec")}
            records.append(dict(med, model=model, dataset=dataset, data_workers=workers,
                                batch=batch, launches=results))
            rows.append([f"{model} imagenet", dataset, workers,
                         f"{100 * med['data_time_fraction']:.1f}%",
                         f"{1e3 * med['step_time_s']:.0f}", f"{med['images_per_sec']:.1f}"])
    table = harness.format_table(["model", "data", "--data-workers", "data wait / step time",
                                  "step ms (median)", "img/s"], rows)
    shown = ", ".join(f"{m} batch {b}, {n} steps" for m, _, _, b, n, _ in runs)
    return table + (f"\n\n2 ranks x 1 compute thread (mpiexec -n 2), global batch and steps "
                    f"({shown}) with 3 warm-up steps; medians of {rounds} launches per row, "
                    f"worker counts alternated"), records


# -- 3. memory of 2 ranks reading one packed set ------------------------------------------

def memory_worker(path, epochs):
    """Under mpiexec: this rank's memory before and after reading its shard of `epochs`."""
    from mpi4py import MPI

    from dynar import data
    comm = MPI.COMM_WORLD
    ds = data.load("packed", data_dir=path, model_input_shape=(3, 224, 224))
    loader = data.Loader(ds, BATCH, rank=comm.rank, world=comm.size, augment=True, workers=1)
    start = _memory()
    for _ in loader.batches(0):        # every batch buffer written, the allocator warm
        pass
    comm.Barrier()
    before = _memory()
    for epoch in range(1, epochs + 1):
        for _ in loader.batches(epoch):
            pass
    comm.Barrier()
    after = _memory()
    loader.close()
    set_bytes = sum(os.path.getsize(f) for f in ds.train.shard_files)
    report = comm.gather({"start": start, "before": before, "after": after}, root=0)
    if comm.rank == 0:
        print(json.dumps({"ranks": report, "set_bytes": set_bytes}))


def _memory():
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1]) * 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"],
            "uss": fields["Private_Clean"] + fields["Private_Dirty"],
            "private_dirty": fields["Private_Dirty"], "anonymous": fields["Anonymous"]}


def _memory_share(sets, quick):
    cmd = _mpiexec(2) + [sys.executable, "-m", "perf.data", "--memory", sets["packed_raw"],
                         "1" if quick else "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"memory run: {out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    size = result["set_bytes"]
    rows = []
    for rank, r in enumerate(result["ranks"]):
        grow = {k: r["after"][k] - r["before"][k] for k in r["before"]}
        warm = r["before"]["anonymous"] - r["start"]["anonymous"]
        rows.append([rank, f"{warm / 2**20:.0f}"]
                    + [f"{grow[k] / 2**20:+.1f} ({100 * grow[k] / size:+.1f}%)"
                       for k in ("rss", "pss", "uss", "private_dirty", "anonymous")])
    table = harness.format_table(["rank", "first epoch: anonymous MB", "then: RSS MB (% of set)",
                                  "PSS", "USS", "private dirty", "anonymous"], rows)
    epochs = "1 epoch" if quick else "2 epochs"
    return table + (f"\n\nmpiexec -n 2, each rank reading its shard of a "
                    f"{size / 2**20:.0f} MB raw-pixel packed set; the first epoch writes the "
                    f"batch buffers (prefetch slots) and warms the allocator, then the growth "
                    f"over {epochs} more. USS counts the mapped shard pages only this rank has "
                    f"touched (page cache, shared as soon as the other rank maps them); "
                    f"private dirty and anonymous memory are what a copy would add"), result


def _python(args):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                         env=_env(), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def run(quick=False):
    per_class = 16 if quick else 64
    root = os.path.join(tempfile.gettempdir(), f"dynar-perf-data-{per_class}")
    os.makedirs(root, exist_ok=True)
    start = time.monotonic()
    sets = build_sets(root, per_class)
    print(f"(data sets in {root}: built in {time.monotonic() - start:.0f} s)\n", flush=True)
    parts, payload = [], {}
    for title, key, fn in (("Decode + augment throughput", "throughput", _throughput),
                           ("Data wait while training, 2 ranks", "data_wait", _data_wait),
                           ("Memory of 2 ranks reading one packed set", "memory", _memory_share)):
        table, payload[key] = fn(sets, quick)
        parts.append(f"### {title}\n\n{table}")
        print(parts[-1] + "\n", flush=True)
    payload["table"] = "\n\n".join(parts)
    print(f"wrote {harness.write_result('data', payload)}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--throughput":
        throughput_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--memory":
        memory_worker(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m perf data (this module's __main__ runs the workers)")
