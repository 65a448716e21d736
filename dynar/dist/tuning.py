"""Measuring the allreduce algorithms on the job's own communicator, the tuning files that
keep the result, and finding the cost model a job plans with.

`measure` times every algorithm over a range of message sizes (median of repeats, slowest
rank); `fit` turns those samples into a CostModel (per-algorithm α + β·n for this
communicator, plus the machine's α-β-γ link model when the samples separate them).
`save_tuning`/`load_tuning` keep a model under a key naming the job's shape (ranks, ranks per
node, nodes, MPI library, link), not its hosts: a file made on some nodes serves the same
shape on others. `cost_model_for` is what the synchronizer calls: it loads the tuning
file that matches the job's shape or, when none does, runs a brief tune and saves it. Rank 0
decides and broadcasts, so every rank plans with the identical model.

Importing this does not load MPI (the tuning-file functions need none).
"""
import datetime
import hashlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..atomic_write import write_text
from . import costmodel, interconnect, runtime

_TUNING_FORMAT = "dynar-tuning"
_TUNING_VERSION = 1

# A thorough tune (python -m dynar.tune) and the brief one a job runs on first use.
FULL_SIZES = [4 << k for k in range(0, 27, 2)]            # 4 B ... 256 MB
FULL_REPEATS = 7
BRIEF_SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]
BRIEF_REPEATS = 3


def tuning_key(ranks, ranks_per_node, nodes, mpi_library, link):
    """A short stable hex key for a job shape: ranks, ranks per node, nodes, the MPI library
    (its version string) and the link between the nodes (dist/interconnect.py). Host names
    are not part of it: a file tuned on some nodes serves the same shape on any others."""
    costmodel.check_ranks(ranks, ranks_per_node)
    fields = {"ranks": int(ranks), "ranks_per_node": int(ranks_per_node), "nodes": int(nodes),
              "mpi_library": str(mpi_library), "link": str(link)}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return digest[:16]


def tuning_dir():
    """Where tuning files live: $DYNAR_TUNE_DIR, else ~/.cache/dynar/tune."""
    env = os.environ.get("DYNAR_TUNE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dynar" / "tune"


def _tuning_path(key, directory):
    # The key becomes a file name: keep it to characters that cannot leave the directory.
    if not isinstance(key, str) or not re.fullmatch(r"[0-9A-Za-z_-]+", key):
        raise ValueError(f"tuning key must be letters, digits, '_' or '-', got {key!r}")
    return Path(directory if directory is not None else tuning_dir()) / f"{key}.json"


def save_tuning(model, key, meta, directory=None):
    """Write `model` under `key` (into `directory`, default tuning_dir()); returns the path.

    meta: a json-serializable dict stored alongside, meant to hold the fields the key was
    made from (ranks, ranks_per_node, nodes, mpi_library, link) and anything else worth
    keeping (date, dynar version), so a file explains itself. Written atomically: concurrent
    readers (other ranks, other jobs) see the old file or the new one, never half of one."""
    path = _tuning_path(key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"format": _TUNING_FORMAT, "version": _TUNING_VERSION,
                                 "key": key, "meta": meta, "model": model.to_json()},
                                indent=2, sort_keys=True) + "\n")
    return path


def load_tuning(key, directory=None, largest=0):
    """The CostModel saved under `key`, or None if there is none, or if its largest measured
    message is below `largest` bytes (the job would price its big buckets off a fit made on
    small ones: a LeNet job's brief tune, reused by AlexNet on the same hosts, chose
    Rabenseifner at 2x the ring's time). A file that is not valid JSON, not a dynar tuning
    file, saved under another key, or malformed (its meta, a cost that is NaN or negative)
    raises ValueError naming it."""
    path = _tuning_path(key, directory)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: corrupt tuning file ({exc}); delete it to re-tune") from None
    if not isinstance(data, dict) or data.get("format") != _TUNING_FORMAT:
        raise ValueError(f"{path}: not a dynar tuning file; delete it to re-tune")
    if data.get("version") != _TUNING_VERSION:
        raise ValueError(f"{path}: tuning file version {data.get('version')!r}, this dynar "
                         f"reads version {_TUNING_VERSION}; delete it to re-tune")
    if data.get("key") != key:
        raise ValueError(f"{path}: holds key {data.get('key')!r}, expected {key!r}")
    meta = data.get("meta") or {}
    measured = meta.get("sizes") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or measured is not None and not (
            isinstance(measured, list) and measured and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in measured)):
        raise ValueError(f"{path}: malformed tuning file (meta {_short(meta)}: expected an "
                         f"object whose sizes are the measured message sizes); delete it to "
                         f"re-tune")
    if max(measured or [largest]) < largest:
        return None
    try:
        return costmodel.CostModel.from_json(data.get("model"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}; delete it to re-tune") from None


def _short(value, limit=80):
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- measuring ------------------------------------------------------------------------------


def measure(collective, sizes, repeats, algorithms=costmodel.ALGORITHMS, progress=None):
    """[sample dict] for each (algorithm, size): the median over `repeats` timed calls after
    one warm-up, the slowest rank's. Collective over the communicator."""
    comm = collective.comm_handle
    MPI = runtime.mpi()
    samples = []
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        for algorithm in algorithms:
            collective.allreduce_mean(x, algorithm)
            times = []
            for _ in range(repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                collective.allreduce_mean(x, algorithm)
                times.append(time.perf_counter() - t0)
            slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)
            samples.append({"algorithm": algorithm, "ranks": collective.size,
                            "ranks_per_node": collective.local_size, "nbytes": x.nbytes,
                            "seconds": slowest})
            if progress is not None:
                progress(samples[-1])
    return samples


def fit(samples, ranks, ranks_per_node):
    """CostModel from measure()'s samples: per-algorithm fits, and the link model when the
    samples can separate α, β and γ (else the record goes without it)."""
    costs = costmodel.fit_algorithms(samples)
    try:
        link = costmodel.fit_link(samples)
    except ValueError:
        link = None
    return costmodel.CostModel(ranks, ranks_per_node, costs, link=link)


def job_key(collective):
    """(key, meta) naming this job's shape: ranks, ranks per node, nodes, MPI library, link.
    meta also lists the hosts, to say where a file was made. Collective (gathers each
    rank's host name and link)."""
    MPI = runtime.mpi()
    comm = collective.comm_handle
    hosts, links = zip(*comm.allgather((MPI.Get_processor_name(), interconnect.describe())))
    meta = {"ranks": collective.size, "ranks_per_node": collective.local_size,
            "nodes": collective.nodes,
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00"),
            "link": "; ".join(sorted(set(links))), "hostnames": sorted(set(hosts))}
    key = tuning_key(meta["ranks"], meta["ranks_per_node"], meta["nodes"], meta["mpi_library"],
                     meta["link"])
    return key, meta


def tune(collective, sizes=FULL_SIZES, repeats=FULL_REPEATS, directory=None, progress=None,
         must_save=True):
    """Measure, fit and save (rank 0 writes). Returns (model, path or None, samples). A file
    that cannot be written raises OSError on rank 0, or without must_save is reported on
    stderr and skipped: a training job's brief tune still has its model."""
    key, meta = job_key(collective)
    samples = measure(collective, sizes, repeats, progress=progress)
    model = fit(samples, collective.size, collective.local_size)
    path = None
    if collective.rank == 0:
        meta.update(tuned=datetime.datetime.now().isoformat(timespec="seconds"),
                    sizes=list(sizes), repeats=repeats)
        try:
            path = save_tuning(model, key, meta, directory)
        except OSError as exc:
            if must_save:
                raise
            print(f"dynar: warning: cannot save the tuning file ({exc}); this job uses its "
                  f"fit unsaved", file=sys.stderr, flush=True)
    return model, path, samples


def cost_model_for(collective, max_bytes, directory=None):
    """(model, source): the saved model for this job's shape if it measured messages as large
    as the job's brief tune would, else a brief tune over sizes up to the job's largest
    possible bucket (saved for next time). source says which."""
    key, _ = job_key(collective)
    comm = collective.comm_handle
    sizes = [s for s in BRIEF_SIZES if s <= max(max_bytes, BRIEF_SIZES[1])]
    found = None
    if collective.rank == 0:
        try:
            model = load_tuning(key, directory, largest=sizes[-1])
            found = None if model is None else model.to_json()
        except (ValueError, OSError) as exc:    # a corrupt or unreadable file: tune again
            print(f"dynar: warning: {exc} (tuning again now)", file=sys.stderr, flush=True)
            found = {"error": str(exc)}
    found = comm.bcast(found, root=0)
    if found is not None and "error" not in found:
        return costmodel.CostModel.from_json(found), f"tuning file {key}"
    model, _, _ = tune(collective, sizes, BRIEF_REPEATS, directory, must_save=False)
    # Every rank fitted the same samples (maxed over ranks), but take rank 0's to be sure.
    model = costmodel.CostModel.from_json(comm.bcast(model.to_json(), root=0))
    return model, f"brief tune {key}"
