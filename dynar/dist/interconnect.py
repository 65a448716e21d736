"""The interconnect: what carries a job's traffic between nodes, in a few words: part of the job shape that a
tuning file is keyed by (dist/tuning.py), so a file tuned on some nodes serves other nodes
with the same interconnect, and none with another.

DYNAR_LINK, when set, is the description (a site's name for its fabric; perf/cluster sets
the emulated link's rate there). Otherwise it is read from sysfs: each network device that
is up and backed by hardware (its kind and speed) and each active InfiniBand port (its
rate). Virtual devices (bridges, veth, tunnels) are left out: they are the host's plumbing,
and on a login node or a container host they come and go with other people's jobs.
"""
import os
from pathlib import Path

# ARPHRD_* device types (linux/if_arp.h) that name a fabric.
_KINDS = {"1": "ethernet", "32": "infiniband"}


def _read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:     # absent, or a driver that refuses the read (speed of a virtio NIC)
        return ""


def _device(dev):
    kind = _KINDS.get(_read(dev / "type"), f"device type {_read(dev / 'type') or '?'}")
    speed = _read(dev / "speed")
    if speed.isdigit() and int(speed) > 0:
        mbit = int(speed)
        return f"{kind} {mbit // 1000} Gb/s" if mbit % 1000 == 0 else f"{kind} {mbit} Mb/s"
    return f"{kind}, speed not reported"


def describe(sysfs="/sys"):
    """This node's link, e.g. "ethernet 25 Gb/s, infiniband 200 Gb/sec (4X HDR)"."""
    named = os.environ.get("DYNAR_LINK", "").strip()
    if named:
        return named
    found = set()
    net = Path(sysfs) / "class" / "net"
    for dev in (net.iterdir() if net.is_dir() else ()):
        if (dev / "device").exists() and _read(dev / "operstate") == "up":
            found.add(_device(dev))
    for port in (Path(sysfs) / "class" / "infiniband").glob("*/ports/*"):
        if "ACTIVE" in _read(port / "state"):
            found.add(f"infiniband {_read(port / 'rate') or 'rate not reported'}")
    return ", ".join(sorted(found)) or "no hardware network device"
