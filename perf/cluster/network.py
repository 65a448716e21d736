"""The emulated network: one Linux network namespace per host, a veth pair from each to a
bridge, and a token-bucket (tbf) shaper on both ends of every veth.

    root namespace: bridge dynar-<id>-br, 10.77.K.254/24 (mpiexec's daemons call back here)
        |-- dynar-<id>-v0 == eth0 in namespace dynar-<id>-h0, 10.77.K.1/24
        |-- dynar-<id>-v1 == eth0 in namespace dynar-<id>-h1, 10.77.K.2/24
        ...

Why both ends: a qdisc only shapes what a device *sends*. The tbf on `eth0` inside a
namespace limits what that host sends; the tbf on its bridge-side end limits what the
bridge delivers to it (the host's receive side, where several senders converge in an
allreduce). So host-to-host traffic crosses two shapers at the configured rate, like a NIC
on each side of a switch.

Burst: tbf refills tokens on (high-resolution) timers, so a small bucket is enough on this
kernel; a bucket of 1 ms at the rate (at least 128 KiB, above the 64 KiB GSO super-packets
veth passes) reached 95.5% of 1 and 10 Gbit/s and 91% of 25 Gbit/s with one TCP stream
(TCP payload is 1448 of the 1514 bytes tbf counts per full-size frame: 95.6% at most).
"""
import functools
import os
import re
import shutil
import signal
import subprocess
import time

from . import registry
from .errors import ClusterError

# Sizes tc counts for a full-size frame vs the TCP payload in it (MTU 1500, timestamps on):
# the best goodput one TCP stream can reach through a shaper at rate R is R * 1448/1514.
TCP_GOODPUT_FRACTION = 1448 / 1514
QUEUE_LATENCY = "10ms"
SUBNET_PREFIX = "10.77"
MAX_HOSTS = 253  # .1 ... .253 in a /24; .254 is the root namespace's address

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_rate(rate):
    """Link rate in bit/s from tc-style text ("1gbit", "10gbit", "500mbit") or a number of
    bit/s. Units are decimal as in tc; "gbps" (bytes in tc's notation) is refused as
    ambiguous."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        m = _RATE_RE.match(str(rate))
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ClusterError(f"rate {rate!r}: expected a number and one of the units "
                               f"{', '.join(_UNITS)} (e.g. 10gbit)")
        bits = float(m.group(1)) * _UNITS[unit]
    if not bits >= 1000:
        raise ClusterError(f"rate {rate!r}: must be at least 1kbit")
    return int(bits)


def format_rate(bits):
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def tbf_args(bits):
    """tc arguments of a token bucket at `bits` bit/s."""
    burst = max(bits // 8 // 1000, 128 * 1024)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", QUEUE_LATENCY]


def run_cmd(argv, check=True):
    """Run an ip/tc command; a failure becomes a ClusterError naming the command."""
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def missing_tools():
    return [t for t in ("ip", "tc", "unshare", "hostname") if shutil.which(t) is None]


def subnet_candidates():
    return [f"{SUBNET_PREFIX}.{k}.0/24" for k in range(256)]


def subnets_in_use():
    """/24 subnets under 10.77 that some interface of the root namespace already has."""
    out = run_cmd(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    return {f"{SUBNET_PREFIX}.{k}.0/24"
            for k in re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.\d+/", out)}


def kernel_objects():
    """run id -> {"namespaces": [...], "links": [...]} for every dynar-<id>- object."""
    found = {}
    ns_out = run_cmd(["ip", "netns", "list"], check=False).stdout
    for line in ns_out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = registry.NAME_RE.match(name)
        if m:
            found.setdefault(m.group(1), {"namespaces": [], "links": []})["namespaces"].append(name)
    link_out = run_cmd(["ip", "-o", "link", "show"], check=False).stdout
    for line in link_out.splitlines():
        # "7: dynar-ab12-v0@if2: <...>": the name ends at '@' (veth) or ':'.
        name = line.split(":", 2)[1].strip().split("@")[0] if ":" in line else ""
        m = registry.NAME_RE.match(name)
        if m:
            found.setdefault(m.group(1), {"namespaces": [], "links": []})["links"].append(name)
    return found


def pids_in(namespace):
    """Processes whose network namespace is `namespace`."""
    out = run_cmd(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split()]


def kill_processes_in(namespaces, grace=2.0):
    """End the processes still running inside `namespaces` (MPI daemons and ranks of this
    run): SIGTERM, then SIGKILL after `grace` seconds. A namespace whose processes live on
    would survive `ip netns del` unseen."""
    kill_processes(lambda: [p for ns in namespaces for p in pids_in(ns) if p != os.getpid()],
                   grace)


def kill_processes(pids, grace=2.0):
    """SIGTERM to `pids` (a list, or a function listing those still alive), then SIGKILL to
    any left after `grace` seconds."""
    alive = pids if callable(pids) else lambda: [p for p in pids if _running(p)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive():
                return
            time.sleep(0.05)


def _running(pid):
    """Alive and not a zombie (a zombie is gone but for its parent's wait)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove(namespaces, links):
    """Delete links and namespaces; missing ones are fine. Links go first: deleting a veth
    end removes its peer at once, whereas a deleted namespace's devices are freed later
    by the kernel, so they would linger for a moment after `ip netns del`."""
    kill_processes_in(namespaces)
    for link in links:
        run_cmd(["ip", "link", "del", link], check=False)
    for ns in namespaces:
        run_cmd(["ip", "netns", "del", ns], check=False)


class Network:
    """Namespaces, veths, bridge and shapers of one run. `create()` builds them (removing
    what it built if a step fails), `destroy()` removes them and is safe to call twice."""

    def __init__(self, run_id, subnet, hosts, rate_bits):
        self.run_id, self.subnet, self.hosts, self.rate_bits = run_id, subnet, hosts, rate_bits
        name = f"{registry.PREFIX}{run_id}"
        base = subnet.rsplit(".", 1)[0]
        self.bridge = f"{name}-br"
        self.namespaces = [f"{name}-h{i}" for i in range(hosts)]
        self.veths = [f"{name}-v{i}" for i in range(hosts)]  # bridge-side ends
        self.addresses = [f"{base}.{i + 1}" for i in range(hosts)]
        self.root_address = f"{base}.254"

    def create(self):
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self):
        shaper = tbf_args(self.rate_bits)
        run_cmd(["ip", "link", "add", self.bridge, "type", "bridge"])
        run_cmd(["ip", "addr", "add", f"{self.root_address}/24", "dev", self.bridge])
        run_cmd(["ip", "link", "set", self.bridge, "up"])
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses):
            run_cmd(["ip", "netns", "add", ns])
            run_cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns])
            run_cmd(["ip", "link", "set", veth, "master", self.bridge, "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            run_cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            # MPI's shared-memory transport and PMIx use loopback inside a host.
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root"] + shaper)
            run_cmd(["tc", "qdisc", "add", "dev", veth, "root"] + shaper)

    def remove_shapers(self):
        """Take the tbf off both ends of every link: what is left is bounded only by the
        kernel's TCP work on this machine's cores (the suite's measure of that ceiling)."""
        for ns, veth in zip(self.namespaces, self.veths):
            run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"])
            run_cmd(["tc", "qdisc", "del", "dev", veth, "root"])

    def destroy(self):
        remove(self.namespaces, self.veths + [self.bridge])


@functools.lru_cache(maxsize=1)
def probe():
    """(True, "") if this process can build the network here, else (False, reason).

    Tries each kind of object inside one throwaway namespace, so nothing of the machine's
    own network is touched."""
    if os.geteuid() != 0:
        return False, "needs root (creates network namespaces and tc qdiscs)"
    missing = missing_tools()
    if missing:
        return False, f"missing tools: {', '.join(missing)} (install iproute2, util-linux)"
    with registry.locked():
        run_id, _ = registry.reserve(set(kernel_objects()))
    ns = f"{registry.PREFIX}{run_id}-probe"
    try:
        run_cmd(["ip", "netns", "add", ns])
        run_cmd(["ip", "-n", ns, "link", "add", "name", "probe0", "type", "veth",
                 "peer", "name", "probe1"])
        run_cmd(["ip", "-n", ns, "link", "add", "name", "probebr", "type", "bridge"])
        run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root"] + tbf_args(10**9))
        run_cmd(["ip", "netns", "exec", ns, "unshare", "--uts", "true"])
    except ClusterError as e:
        return False, f"cannot build an emulated network here: {e}"
    finally:
        remove([ns], [])
        registry.release(run_id)
    return True, ""
