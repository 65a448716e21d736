"""Measuring the allreduce algorithms on the job's own communicator, and finding the cost
model a job plans with.

`measure` times every algorithm over a range of message sizes (median of repeats, slowest
rank); `fit` turns those samples into a CostModel (per-algorithm α + β·n for this
communicator, plus the machine's α-β-γ link model when the samples separate them).
`cost_model_for` is what the synchronizer calls: it loads the tuning file that matches the
job's shape or, when none does, runs a brief tune and saves it. Rank 0 decides and
broadcasts, so every rank plans with the identical model.
"""
import datetime
import statistics
import sys
import time

import numpy as np

from . import costmodel, runtime

# A thorough tune (python -m dynar.tune) and the brief one a job runs on first use.
FULL_SIZES = [4 << k for k in range(0, 27, 2)]            # 4 B ... 256 MB
FULL_REPEATS = 7
BRIEF_SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]
BRIEF_REPEATS = 3


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
    """(key, meta) naming this job's shape: ranks, ranks per node, MPI library, hosts.
    Collective (gathers host names)."""
    MPI = runtime.mpi()
    comm = collective.comm_handle
    hosts = comm.allgather(MPI.Get_processor_name())
    meta = {"ranks": collective.size, "ranks_per_node": collective.local_size,
            "nodes": collective.nodes,
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00"),
            "hostnames": sorted(set(hosts))}
    key = costmodel.tuning_key(meta["ranks"], meta["ranks_per_node"], meta["mpi_library"],
                               hosts + [f"nodes={collective.nodes}"])
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
            path = costmodel.save_tuning(model, key, meta, directory)
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
            model = costmodel.load_tuning(key, directory, largest=sizes[-1])
            found = None if model is None else model.to_json()
        except (ValueError, OSError) as exc:    # a corrupt or unreadable file: tune again
            found = {"error": str(exc)}
    found = comm.bcast(found, root=0)
    if found is not None and "error" not in found:
        return costmodel.CostModel.from_json(found), f"tuning file {key}"
    model, _, _ = tune(collective, sizes, BRIEF_REPEATS, directory, must_save=False)
    # Every rank fitted the same samples (maxed over ranks), but take rank 0's to be sure.
    model = costmodel.CostModel.from_json(comm.bcast(model.to_json(), root=0))
    return model, f"brief tune {key}"
