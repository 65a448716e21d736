"""A real Slurm cluster on the emulated hosts, for testing dynar under sbatch and srun.

Debian's daemons, started and stopped here: `munged` (a key and socket of this run's own)
and `slurmctld` in the root namespace, which plays the login node where sbatch, srun and
scontrol run; one `slurmd` per emulated host, inside that host's network namespace and
under its host name (NodeName = the namespace name, NodeAddr = its address). Jobs started
by a slurmd inherit its namespace, so their MPI traffic crosses the shaped links.

It is a Cluster, so it is removed on the same paths (a `with` block, an exception,
SIGTERM/SIGHUP/Ctrl-C, interpreter exit); every daemon also gets SIGTERM from the kernel
when the owning process dies, even by SIGKILL, and `python -m perf.cluster cleanup` ends
any that outlived it.

Why each setting: proctrack/linuxproc and task/none need no cgroup hierarchy (the hosts
share the machine's); a slurmd enters its namespace with nsenter, which keeps the root
namespace's /sys (and its cgroup mounts), where `ip netns exec` would remount /sys; the
spool, TmpFS and PMIx directories are per node (%n), since all hosts share one /tmp; each
slurmd sees an /etc/hosts of its own that names every node (bind-mounted in a private mount
namespace: the machine's file is never touched).
"""
import glob
import os
import re
import shutil
import socket
import subprocess
import time

from . import network, registry
from .cluster import Cluster, _terminate_with_parent, run_supervised
from .errors import ClusterError

# Command -> the Debian package that provides it.
COMMANDS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client", "srun": "slurm-client", "scontrol": "slurm-client",
            "sinfo": "slurm-client", "nsenter": "util-linux"}
# Slurm's pmix plugin dlopens the unversioned library, which only the -dev package has.
PMIX_LIBRARY = "/usr/lib/*/pmix2/lib/libpmix.so"
INSTALL = ("apt-get install slurmd slurmctld slurm-client munge libpmix2 libpmix-dev")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
START_TIMEOUT = 30.0


def missing_packages():
    """Debian packages whose files a Slurm cluster needs and this machine lacks."""
    missing = sorted({pkg for cmd, pkg in COMMANDS.items() if shutil.which(cmd) is None})
    if not glob.glob(PMIX_LIBRARY):
        missing.append("libpmix-dev")
    return missing


def available():
    """(True, "") where a Slurm cluster can be built here, else (False, why)."""
    ok, reason = network.probe()
    if not ok:
        return ok, reason
    missing = missing_packages()
    if missing:
        return False, f"missing Debian packages: {', '.join(missing)} ({INSTALL})"
    return True, ""


class SlurmCluster(Cluster):
    """`hosts` Slurm nodes of `cpus` CPUs each (default: this machine's), one per emulated
    host, links shaped to `rate`. Use as a context manager; then `sbatch`, `srun`, `job`,
    `wait`, `requeue`, `client` (any Slurm command) and `env`."""

    def __init__(self, hosts, rate="10gbit", cpus=None):
        super().__init__(hosts, 1, rate)
        self.cpus = cpus or os.cpu_count() or 1
        self._daemons = []
        self.conf = None

    # -- daemons --------------------------------------------------------------------------

    def _start_services(self):
        missing = missing_packages()
        if missing:
            raise ClusterError(f"Slurm needs the Debian packages {', '.join(missing)} "
                               f"({INSTALL})")
        run = self.run_dir
        # munged insists that every directory above its socket be searchable by all.
        os.chmod(run, 0o711)
        for sub in ["state", "munge"] + [f"{kind}-{ns}" for ns in self.namespaces
                                         for kind in ("spool", "tmp")]:
            os.makedirs(os.path.join(run, sub), mode=0o755)
        self.munge_socket = os.path.join(run, "munge", "socket")
        key = os.path.join(run, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        self._start("munged", ["munged", "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={run}/munged.pid",
                               f"--log-file={run}/munged.log", f"--seed-file={run}/munged.seed"])
        self._wait_for(lambda: os.path.exists(self.munge_socket), "munged's socket")
        self.conf = os.path.join(run, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(self._slurm_conf())
        self._start("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        hosts = self._write_hosts_file()
        for ns in self.namespaces:
            # Host name and /etc/hosts are set before slurmd reads them, in namespaces of
            # its own that every job it starts inherits; exec keeps PDEATHSIG.
            self._start(f"slurmd-{ns}", [
                "nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                'mount --bind "$3" /etc/hosts && hostname "$1" && exec slurmd -D -N "$1" -f "$2"',
                "sh", ns, self.conf, hosts])
        self._wait_for(self._all_idle, f"{self.hosts} idle Slurm nodes")

    def _write_hosts_file(self):
        """The machine's /etc/hosts plus a line per node: the nodes resolve each other's
        names, as on a real cluster (MPICH's launcher connects by host name)."""
        path = os.path.join(self.run_dir, "hosts")
        try:
            with open("/etc/hosts") as f:
                machine = f.read()
        except OSError:
            machine = ""
        with open(path, "w") as f:
            f.write(machine.rstrip("\n") + "\n# perf/cluster/slurm.py: the emulated nodes\n")
            f.writelines(f"{addr} {ns}\n" for addr, ns in zip(self.addresses, self.namespaces))
        os.chmod(path, 0o644)
        return path

    def _start(self, name, argv):
        log = open(os.path.join(self.run_dir, f"{name}.out"), "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=self.env(),
                                preexec_fn=_terminate_with_parent)
        log.close()
        self._daemons.append((name, proc))
        if "slurmd" not in name:    # slurmds live in the namespaces: found and ended there
            registry.record_daemon(self.run_id, proc.pid)

    def _wait_for(self, ready, what):
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            exited = [name for name, proc in self._daemons if proc.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{', '.join(exited)} exited" if exited else \
                    f"not ready after {START_TIMEOUT:g} s"
                raise ClusterError(f"Slurm did not start ({what}: {why}); "
                                   f"{self._log_tail(exited or [n for n, _ in self._daemons])}")
            time.sleep(0.1)

    def _log_tail(self, names, lines=3):
        tails = []
        for name in names:
            try:
                with open(os.path.join(self.run_dir, f"{name}.out")) as f:
                    tail = [line.strip() for line in f.read().splitlines()[-lines:]]
            except OSError:
                tail = []
            tails.append(f"{name}: {' | '.join(tail) or '(no output)'}")
        return "; ".join(tails)

    def _all_idle(self):
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                             text=True, env=self.env(), stdin=subprocess.DEVNULL).stdout
        return out.split().count("idle") == self.hosts

    def _stop_services(self):
        for _, proc in reversed(self._daemons):
            proc.terminate()
        for _, proc in reversed(self._daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons = []

    def _slurm_conf(self):
        run, port = self.run_dir, _free_port(self.network.root_address)
        nodes = "\n".join(
            f"NodeName={ns} NodeAddr={addr} CPUs={self.cpus} Sockets=1 "
            f"CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
            for ns, addr in zip(self.namespaces, self.addresses))
        return f"""\
# Written by perf/cluster/slurm.py for emulated cluster {self.run_id}.
ClusterName=dynar{self.run_id}
SlurmctldHost={socket.gethostname().split(".")[0]}({self.network.root_address})
SlurmctldPort={port}
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again once its credential expires (Slurm's default: 120 s);
# the main scheduling loop then finds it within 2 s (default: 60 s).
AuthInfo=socket={self.munge_socket},cred_expire=10
SchedulerParameters=sched_interval=2
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
StateSaveLocation={run}/state
SlurmdSpoolDir={run}/spool-%n
TmpFS={run}/tmp-%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/spool-%n/slurmd.pid
SlurmdLogFile={run}/spool-%n/slurmd.log
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

    # -- what tests and users call -------------------------------------------------------

    def daemon_pids(self):
        """Pids of munged, slurmctld and the slurmds."""
        return [proc.pid for _, proc in self._daemons]

    def env(self, extra=None):
        """Cluster.env() for Slurm's commands: this cluster's slurm.conf, and none of the
        SLURM_* variables of a job the caller may itself be running in."""
        env = {k: v for k, v in super().env().items() if not k.startswith("SLURM_")}
        if self.conf is not None:
            env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def sbatch(self, script, args=(), sbatch_args=(), env=None, cwd=None):
        """Submit `script` with `args` (sbatch options in `sbatch_args`); returns the job id.
        The job gets this process's environment plus `env` (sbatch's --export=ALL)."""
        self._require_started()
        out = subprocess.run(["sbatch", "--parsable", *sbatch_args, script, *args],
                             capture_output=True, text=True, env=self.env(env), cwd=cwd,
                             stdin=subprocess.DEVNULL, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"sbatch {script} failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def srun(self, argv, srun_args=(), env=None, timeout=None, cwd=None):
        """Run `argv` with srun from the login node; returns the CompletedProcess (text).
        srun is stopped (SIGTERM, then SIGKILL) on timeout, on an exception, and when the
        calling process dies."""
        self._require_started()
        return run_supervised(["srun", *srun_args, *argv], self.env(env), timeout, cwd=cwd)

    def client(self, *argv):
        """Run a Slurm command (scontrol, scancel, squeue, ...) on the login node; returns
        its output, or raises ClusterError with its message."""
        out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env(),
                             stdin=subprocess.DEVNULL, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed: {out.stderr.strip()}")
        return out.stdout

    def job(self, job_id):
        """The job's fields as `scontrol show job` gives them (JobState, ExitCode,
        Restarts, NodeList, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.client("scontrol", "show", "job", "-o",
                                                           job_id)))

    def wait(self, job_id, states=FINAL_STATES, timeout=120.0):
        """Poll until the job is in one of `states` (default: finished); returns job()."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} still {fields.get('JobState')} after "
                                   f"{timeout:g} s (waiting for {', '.join(sorted(states))})")
            time.sleep(0.2)

    def requeue(self, job_id):
        """`scontrol requeue`: Slurm ends the running job (SIGTERM to every process, SIGKILL
        after KillWait) and queues it again; it starts again on its own once the job's
        credential has expired (cred_expire, 10 s here)."""
        self.client("scontrol", "requeue", job_id)


def _free_port(address):
    """A TCP port free on `address` now (slurmctld binds it a moment later)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
