"""Allreduce on this machine: dynar's allreduce (blocking, and nonblocking driven to
completion) against mpi4py's MPI_Allreduce, for message sizes 4 B ... 256 MB.

Bus bandwidth = 2(p-1)/p * bytes / time (the bytes every rank must move in the best
algorithm), so figures for different p compare. Ranks are started by mpiexec
(--bind-to core); each figure is the median over repetitions after a warm-up.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from . import harness
from .dist import _env, _mpiexec
from .models import ROOT

SIZES = [4, 4 << 10, 256 << 10, 4 << 20, 25 << 20, 93 << 20, 256 << 20]
RANKS = [2]


def worker(sizes, repeats):
    import numpy as np
    from dynar.dist import runtime
    MPI = runtime.mpi()
    ar = runtime.allreduce()
    comm = MPI.COMM_WORLD
    results = []
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        methods = {
            "MPI_Allreduce (mpi4py)": lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
            "dynar allreduce_mean (blocking)": lambda: ar.allreduce_mean(x, comm),
            "dynar start_mean + wait (Iallreduce)": lambda: ar.start_mean(x, comm).wait(),
        }
        for name, fn in methods.items():
            fn()
            times = []
            for _ in range(repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)
            results.append({"bytes": x.nbytes, "method": name, "time_s": slowest,
                            "samples": times})
    if comm.Get_rank() == 0:
        print(json.dumps(results))


def run(quick=False):
    repeats = 3 if quick else 7
    sizes = [s for s in SIZES if not quick or s <= 25 << 20]
    rows, records = [], []
    for p in RANKS:
        cmd = _mpiexec(p) + [sys.executable, "-m", "perf.allreduce", "--worker",
                             ",".join(map(str, sizes)), str(repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                             timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"allreduce worker on {p} ranks: {out.stderr.strip()[-2000:]}")
        for rec in json.loads(out.stdout.strip().splitlines()[-1]):
            rec["ranks"] = p
            rec["bus_gbytes_per_s"] = 2 * (p - 1) / p * rec["bytes"] / rec["time_s"] / 1e9
            records.append(rec)
            rows.append([p, f"{rec['bytes']:,}", rec["method"], f"{1e3 * rec['time_s']:.3f}",
                         f"{rec['bus_gbytes_per_s']:.2f}"])
    table = harness.format_table(["ranks", "bytes", "method", "ms", "bus GB/s"], rows)
    print(table)
    path = harness.write_result("allreduce", {"runs": records, "table": table})
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m perf allreduce (this module's __main__ is the worker)")
