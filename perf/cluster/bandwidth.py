"""Host-to-host TCP bandwidth on a running emulated cluster (stream_probe.py does the
sending and receiving inside the namespaces)."""
import json
import os
import subprocess
import sys

from .errors import ClusterError

PORT = 5201  # each emulated host has its own port space, so a fixed port can't collide
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(cluster, seconds=2.0, src=0, dst=1):
    """One TCP stream from host `src` to host `dst` of a running Cluster for `seconds`;
    returns the receiver's result dict."""
    if cluster.hosts < 2:
        raise ClusterError("a bandwidth measurement needs at least 2 hosts")
    return _streams(cluster, seconds, [(src, dst)])[0]


def measure_ring(cluster, seconds=2.0):
    """Every host streams to the next one at once (the ring allreduce's traffic, without MPI
    and without sums): what the emulation carries when all hosts' TCP work shares the
    machine's cores. Returns one receiver result dict per host."""
    if cluster.hosts < 2:
        raise ClusterError("a bandwidth measurement needs at least 2 hosts")
    return _streams(cluster, seconds, [(i, (i + 1) % cluster.hosts)
                                       for i in range(cluster.hosts)])


def _streams(cluster, seconds, pairs):
    me = [sys.executable, "-m", "perf.cluster.stream_probe"]
    env = cluster.env()
    receivers, senders = [], []
    try:
        for _, dst in pairs:
            receivers.append(subprocess.Popen(
                cluster.in_host(dst, me + ["receive", str(PORT)]), stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL, text=True, env=env, cwd=_ROOT))
        for receiver in receivers:
            if receiver.stdout.readline().strip() != "listening":
                raise RuntimeError("bandwidth receiver did not start")
        for src, dst in pairs:
            senders.append(subprocess.Popen(
                cluster.in_host(src, me + ["send", cluster.addresses[dst], str(PORT),
                                           str(seconds)]),
                env=env, cwd=_ROOT, stdin=subprocess.DEVNULL))
        for sender in senders:
            if sender.wait(timeout=seconds + 30) != 0:
                raise RuntimeError(f"bandwidth sender failed (exit {sender.returncode})")
        outputs = [receiver.communicate(timeout=30)[0] for receiver in receivers]
    finally:
        for proc in receivers + senders:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for receiver in receivers:
        if receiver.returncode != 0:
            raise RuntimeError(f"bandwidth receiver failed (exit {receiver.returncode})")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]
