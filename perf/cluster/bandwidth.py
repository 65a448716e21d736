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
    me = [sys.executable, "-m", "perf.cluster.stream_probe"]
    env = cluster.env()
    receiver = subprocess.Popen(cluster.in_host(dst, me + ["receive", str(PORT)]),
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                env=env, cwd=_ROOT)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise RuntimeError("bandwidth receiver did not start")
        subprocess.run(cluster.in_host(src, me + ["send", cluster.addresses[dst], str(PORT),
                                                  str(seconds)]),
                       check=True, env=env, cwd=_ROOT, stdin=subprocess.DEVNULL,
                       timeout=seconds + 30)
        out, _ = receiver.communicate(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if receiver.returncode != 0:
        raise RuntimeError(f"bandwidth receiver failed (exit {receiver.returncode})")
    return json.loads(out.strip().splitlines()[-1])
