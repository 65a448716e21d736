"""Who owns which emulated cluster: run ids, owner records, and finding leftovers.

Every kernel object a run creates (namespaces, veth ends, the bridge) is named
`dynar-<id>-...` with a 4-hex-digit run id, and the run's temporary files live in
`<tmp>/dynar-cluster-<id>/`. That directory is created *first*, holding an `owner` file
(pid and kernel start time of the owning process, and the subnet taken). So:

- a concurrent run never reuses an id or subnet that a live run holds;
- `cleanup` can tell a killed run's leftovers (owner gone) from a running cluster's
  (owner alive) and only removes the former. The start time guards against pid reuse.

Reservation happens under a lock (flock on the temporary directory) so that two runs
starting together can't pick the same id or subnet.
"""
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile

from .errors import ClusterError

PREFIX = "dynar-"
# Kernel interface names are at most 15 characters: "dynar-" + 4 hex + "-v253" fits.
NAME_RE = re.compile(r"^dynar-([0-9a-f]{4})-")
RUN_DIR_RE = re.compile(r"^dynar-cluster-([0-9a-f]{4})$")


def tmp_root():
    return tempfile.gettempdir()


def run_dir(run_id):
    return os.path.join(tmp_root(), f"dynar-cluster-{run_id}")


@contextlib.contextmanager
def locked():
    """Serialize reservations and cleanups of all runs on this machine. The lock is taken
    on the temporary directory itself, so that no lock file is left behind."""
    fd = os.open(tmp_root(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _start_time(pid):
    """The kernel's start time of process `pid` (clock ticks since boot), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; split after the command name, which may itself contain spaces or ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def read_owner(run_id):
    try:
        with open(os.path.join(run_dir(run_id), "owner")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def owner_alive(run_id):
    owner = read_owner(run_id)
    return owner is not None and _start_time(owner["pid"]) == owner["start_time"]


def reserve(used_ids, used_subnets=(), subnet_candidates=None):
    """Create a fresh run directory owned by this process; returns (run_id, subnet).

    `used_ids`/`used_subnets` are what already exists in the kernel (a leftover from a
    killed run must not be reused before `cleanup`); `subnet_candidates` lists subnets
    in order of preference (None: the run needs no subnet). Call under `locked()`."""
    used_ids = set(used_ids) | run_ids_on_disk()
    taken = set(used_subnets)
    taken.update((read_owner(i) or {}).get("subnet") for i in run_ids_on_disk())
    subnet = next((s for s in subnet_candidates or () if s not in taken), None)
    if subnet is None and subnet_candidates is not None:
        raise ClusterError("no free subnet for an emulated cluster (remove leftovers with "
                           "`python -m perf.cluster cleanup`)")
    run_id = secrets.token_hex(2)
    while run_id in used_ids:
        run_id = secrets.token_hex(2)
    path = run_dir(run_id)
    os.makedirs(path, mode=0o700)
    pid = os.getpid()
    with open(os.path.join(path, "owner"), "w") as f:
        json.dump({"pid": pid, "start_time": _start_time(pid), "subnet": subnet}, f)
    return run_id, subnet


def record_daemon(run_id, pid):
    """Note a process this run started outside its namespaces (Slurm's controller), so
    that `cleanup` can end it should the owner be killed before stopping it."""
    with open(os.path.join(run_dir(run_id), "daemons"), "a") as f:
        f.write(json.dumps({"pid": pid, "start_time": _start_time(pid)}) + "\n")


def recorded_daemons(run_id):
    """Pids of the run's recorded daemons that are still the processes recorded."""
    try:
        with open(os.path.join(run_dir(run_id), "daemons")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []
    return [r["pid"] for r in records if _start_time(r["pid"]) == r["start_time"]]


def release(run_id):
    shutil.rmtree(run_dir(run_id), ignore_errors=True)


def run_ids_on_disk():
    return {m.group(1) for m in map(RUN_DIR_RE.match, os.listdir(tmp_root())) if m}
