"""An emulated multi-node cluster on one Linux machine, for measuring dynar's allreduce and
distributed training over real (shaped) links.

Each emulated host is a network namespace with one veth link to a bridge; a tbf shaper on
both ends of every link holds it to the chosen rate (network.py). mpiexec starts its
daemons inside the namespaces through an ssh stand-in (`agent`), so between hosts MPI
goes over TCP through the shaped links and inside a host over shared memory; each host
has its own hostname, so MPI_Comm_split_type(COMM_TYPE_SHARED) groups exactly the ranks
of one host, and DYNAR_NODE_KEY=<host index> is set in every rank (cluster.py). Needs
root, iproute2 (ip, tc) and util-linux (unshare). The hostfile names hosts by address,
so /etc/hosts is never touched. Since the "remote" daemons are started on this machine,
ranks see the launcher's whole environment (c.env()), with DYNAR_NODE_KEY per host.

Command line (or `perf/cluster/run ...` from anywhere):

    python -m perf.cluster exec --hosts 4 --ranks-per-host 1 --rate 10gbit -- \\
        python -m dynar.train --model lenet ...     # exit code forwarded
    python -m perf.cluster check --hosts 2 --rate 1gbit   # bandwidth within 15%?
    python -m perf.cluster cleanup                        # leftovers of killed runs

Python:

    from perf.cluster import Cluster, available, run_on_cluster
    ok, reason = available()                  # (False, why) where it can't work
    with Cluster(hosts=4, ranks_per_host=1, rate="10gbit") as c:
        subprocess.run(c.mpiexec([sys.executable, "-m", "dynar.train", ...]),
                       env=c.env({"OMP_NUM_THREADS": "1"}))
        proc = c.run(argv, timeout=600)       # the same, captured, stopped on timeout
        c.in_host(0, argv)                    # argv running a plain program on host 0
    proc = run_on_cluster(4, 1, "10gbit", argv, timeout=600)   # build, run, remove

- `Cluster(hosts, ranks_per_host=1, rate="1gbit")`: rate as tc writes it ("500mbit",
  "1gbit", "25gbit") or bit/s; bad values raise ClusterError naming the problem.
- `c.mpiexec(cmd, mpi_args=())` -> full argv: mpiexec, its flags, `-n H*R`, `cmd`.
  Ranks are placed host-major (ranks 0..R-1 on host 0, ...).
- `c.env(extra=None)` -> environment: root allowed for Open MPI, the repo on PYTHONPATH.
- `c.run(cmd, timeout=None, env=None, capture=True, mpi_args=(), cwd=None)` ->
  CompletedProcess; mpiexec is stopped (SIGTERM, then SIGKILL) on timeout, on an
  exception, and when the calling process dies.
- `c.namespaces`, `c.addresses`, `c.subnet`, `c.size`, `c.rate_bits`.
- `run_on_cluster(hosts, ranks_per_host, rate, argv, timeout=None, env=None,
  capture=True, cwd=None, mpi_args=())` -> CompletedProcess.
- `allreduce_on_cluster(hosts, ranks_per_host, rate, nbytes=8 MiB, warmup=3, repeats=10,
  algorithm=None)` -> timing of MPI_Allreduce with its bound (suite.py).
- `cleanup_leftovers(force=False)` -> (removed run ids, kept run ids of live runs);
  `leftovers()` -> run ids that still have anything on the machine.
- `measure_bandwidth(c, seconds=2.0, src=0, dst=1)` -> one TCP stream's result
  (Gbit/s received by host dst), bandwidth.py; `measure_ring_bandwidth(c, seconds=2.0)`
  -> one result per host, every host streaming to the next at once.
- `run(quick=False)`: the benchmark suite (`python -m perf cluster`), see suite.py.

A real Slurm on the emulated hosts (slurm.py; Debian's slurmd, slurmctld, slurm-client,
munge, libpmix2 and libpmix-dev):

    from perf.cluster.slurm import SlurmCluster, available
    with SlurmCluster(hosts=2, rate="10gbit") as s:   # munged, slurmctld, a slurmd per host
        job = s.sbatch("job.sh", args, ["--nodes=2", "--output=out"])   # -> job id
        s.wait(job)                           # -> scontrol's fields: JobState, ExitCode...
        s.srun(argv, ["--mpi=pmix", "-N2"])   # -> CompletedProcess
        s.requeue(job)                        # scontrol requeue: it starts again 10 s later
"""
from .bandwidth import measure as measure_bandwidth
from .bandwidth import measure_ring as measure_ring_bandwidth
from .cluster import Cluster, cleanup_leftovers, leftovers, run_on_cluster
from .errors import ClusterError
from .network import format_rate, parse_rate
from .network import probe as available
from .suite import allreduce_on_cluster, run

__all__ = ["Cluster", "ClusterError", "available", "run_on_cluster", "cleanup_leftovers",
           "leftovers", "parse_rate", "format_rate", "measure_bandwidth",
           "measure_ring_bandwidth",
           "allreduce_on_cluster", "run"]
