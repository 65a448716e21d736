"""Allreduce algorithms against the MPI library's MPI_Allreduce and the link's lower bound.

For message sizes 4 B ... 256 MB and p = 2, 3, 4 ranks: every dynar algorithm (and the ring
with fp16 on the wire) against mpi4py's MPI_Allreduce, alternated size by size, medians of
the slowest rank; and the ring's transfers alone as plain MPI_Sendrecv calls (no sums), how
fast the MPI library itself moves the ring's bytes. Bus bandwidth = 2(p-1)/p * bytes / time,
the bytes every rank must move in the best algorithm, so figures for different p compare;
the ring lower bound of a link of bandwidth B is 2(p-1)/p * n / B. On loopback the "link" is
shared memory, its B measured in the same run (a large point-to-point exchange); on the
emulated cluster it is the shaped rate.

`measure(launch, ...)` is shared with the cluster suite, which launches the same worker on
emulated hosts.
"""
import json
import statistics
import subprocess
import sys
import time

from . import harness, plots
from .dist import _env, _mpiexec
from .models import ROOT

SIZES = [4 << k for k in range(0, 27, 2)]           # 4 B, 16 B, ... 256 MB
QUICK_SIZES = [4, 4 << 10, 256 << 10, 4 << 20]
RANKS = [2, 3, 4]
QUICK_RANKS = [2, 4]
PEER = "MPI_Allreduce (mpi4py)"
TRANSFERS = "ring's transfers alone (MPI_Sendrecv)"


def worker(sizes, repeats):
    """One rank: prints (rank 0) a JSON list of {bytes, method, time_s, samples} and the
    measured point-to-point bandwidth between ranks 0 and 1."""
    import numpy as np
    from dynar.dist import runtime
    from dynar.dist.algorithms import ALGORITHMS
    from dynar.dist.collective import Collective
    MPI = runtime.mpi()
    comm = MPI.COMM_WORLD
    collective = Collective(comm)
    rank, size = comm.Get_rank(), comm.Get_size()

    def timed(fn):
        fn()
        times = []
        for _ in range(repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return comm.allreduce(statistics.median(times), op=MPI.MAX), times

    def ring_transfers(x):
        # A ring allreduce's 2(p-1) neighbour exchanges of n/p elements, without the sums,
        # each a plain blocking MPI_Sendrecv: how fast the MPI library moves the ring's bytes
        # when asked the simple way. (Not a ceiling: dynar's ring overlaps segments and
        # waits without spinning, and can beat it.)
        part = x[:-(-x.size // size)]
        got = np.empty_like(part)
        right, left = (rank + 1) % size, (rank - 1) % size
        for _ in range(2 * (size - 1)):
            comm.Sendrecv(part, right, 1, got, left, 1)

    # The link: 64 MB each way between ranks 0 and 1 at once (the ring's traffic pattern).
    probe = np.ones(16 << 20, np.float32)
    back = np.empty_like(probe)
    peer = 1 - rank if rank < 2 else MPI.PROC_NULL
    seconds, _ = timed(lambda: comm.Sendrecv(probe, peer, 0, back, peer, 0))
    results = {"link_bytes_per_s": probe.nbytes / seconds, "runs": []}
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        methods = {PEER: lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)}
        for algorithm in ALGORITHMS:
            methods[f"dynar {algorithm}"] = lambda a=algorithm: collective.allreduce_mean(x, a)
        methods["dynar ring fp16 wire"] = lambda: collective.allreduce_mean(x, "ring", "fp16")
        if size > 1:
            methods[TRANSFERS] = lambda x=x: ring_transfers(x)
        for name, fn in methods.items():
            t, samples = timed(fn)
            results["runs"].append({"bytes": x.nbytes, "method": name, "time_s": t,
                                    "samples": samples})
    collective.free()
    if rank == 0:
        print(json.dumps(results), flush=True)


def measure(launch, ranks, sizes, repeats, link_bytes_per_s=None, label="loopback"):
    """Run the worker through `launch(argv) -> CompletedProcess` on `ranks` ranks; returns
    records with bus bandwidth, the ring lower bound and the ratio to the MPI peer.
    link_bytes_per_s: the link's bandwidth (default: the worker's own measurement)."""
    out = launch([sys.executable, "-m", "perf.allreduce", "--worker",
                  ",".join(map(str, sizes)), str(repeats)])
    if out.returncode != 0:
        raise RuntimeError(f"allreduce worker on {ranks} ranks ({label}): "
                           f"{out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    link = link_bytes_per_s or result["link_bytes_per_s"]
    peer = {r["bytes"]: r["time_s"] for r in result["runs"] if r["method"] == PEER}
    records = []
    for rec in result["runs"]:
        factor = 2 * (ranks - 1) / ranks
        bound = factor * rec["bytes"] / link
        rec.update(network=label, ranks=ranks, link_bytes_per_s=link,
                   bus_gbytes_per_s=factor * rec["bytes"] / rec["time_s"] / 1e9,
                   ring_bound_s=bound, fraction_of_bound=bound / rec["time_s"],
                   vs_mpi=peer[rec["bytes"]] / rec["time_s"])
        records.append(rec)
    return records


# The sizes docs/notes/perf-tables.md shows (the JSON and the printed table have every size).
DOC_SIZES = {4, 4 << 10, 256 << 10, 4 << 20, 64 << 20, 256 << 20}


def table(records, sizes=None):
    """Markdown table of the records (only message sizes in `sizes`, if given)."""
    records = [r for r in records if sizes is None or r["bytes"] in sizes]
    rows = [[r["network"], r["ranks"], f"{r['bytes']:,}", r["method"],
             f"{1e3 * r['time_s']:.3f}", f"{r['bus_gbytes_per_s']:.2f}",
             f"{100 * r['fraction_of_bound']:.0f}%", f"{r['vs_mpi']:.2f}x"] for r in records]
    return harness.format_table(["network", "ranks", "bytes", "method", "ms", "bus GB/s",
                                 "of ring bound", "speed vs MPI_Allreduce"], rows)


def plot(records, name):
    """Bus bandwidth against message size, one panel per (network, ranks)."""
    panels = {}
    for r in records:
        panels.setdefault(f"{r['network']}, p={r['ranks']}", {}).setdefault(
            r["method"], []).append((r["bytes"], r["bus_gbytes_per_s"]))
    return plots.line_panels(name, panels, xlabel="message bytes", ylabel="bus GB/s",
                             logx=True, logy=True)


def run(quick=False):
    repeats = 3 if quick else 7
    sizes = QUICK_SIZES if quick else SIZES
    records = []
    for p in QUICK_RANKS if quick else RANKS:
        launch = lambda argv, p=p: subprocess.run(  # noqa: E731
            _mpiexec(p) + argv, capture_output=True, text=True, cwd=ROOT, env=_env(),
            timeout=1800)
        records += measure(launch, p, sizes, repeats)
    print(table(records))
    png = plot(records, "allreduce")
    path = harness.write_result("allreduce", {"runs": records, "table": table(records, DOC_SIZES),
                                              "plot": png})
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return records


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m perf allreduce (this module's __main__ is the worker)")
