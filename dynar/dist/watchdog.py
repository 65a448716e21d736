"""Lost and stalled ranks: a watchdog thread on every rank, linked to rank 0 over TCP beside
MPI, that ends the job with a message naming the ranks at fault.

MPI itself does not help here: a collective with a dead or stopped peer never returns, and
launchers differ in what they do about a dead process (Open MPI's mpiexec kills the rest;
srun by default leaves them waiting). So every rank keeps a TCP connection to rank 0 and
sends it, once a second, how far it has come: how many collectives it has entered (every
rank enters the same ones in the same order, so the counts compare), and whether and for how
long it has been blocked in one (`collectives`, which the collectives report to). Then:

- a connection that ends without a goodbye is a lost rank (killed, or its node gone): every
  rank is told and the job ends at once, naming it;
- when some rank has been blocked for `stall_timeout` seconds, rank 0 names the ranks that
  have not entered that collective, or have sent nothing for as long (stopped, or their node
  is down), and ends the job, as Horovod's stall check does; when every rank is in it, it
  only warns (a slow network or MPI itself);
- a rank blocked that long without hearing from rank 0 ends the job naming rank 0.
Ending the job is MPI_Abort on MPI_COMM_WORLD (the launcher then kills every rank), with
os._exit after a grace period should the MPI library not manage it. A job whose ranks cannot
reach rank 0 over TCP runs without the watchdog, with a warning.
"""
import contextlib
import fcntl
import json
import os
import secrets
import selectors
import socket
import struct
import sys
import threading
import time

from . import runtime

HEARTBEAT_S = 1.0
CONNECT_BUDGET_S = 20.0       # for a rank to reach rank 0 at start-up


class CollectiveTracker:
    """How far this process has come through the job's collectives. One per process (the
    module's `collectives`); the collectives report to it, the watchdog reads it."""

    def __init__(self):
        self.entered = 0          # collectives entered (nested ones not counted)
        self.blocked_in = None    # what it is blocked in, or None
        self.since = 0.0          # monotonic time it became blocked
        self._depth = 0
        self._lock = threading.Lock()

    def inside(self, what):
        """Within: blocked in collective `what` (counted once, however deeply nested)."""
        return self._blocked(what, entering=True)

    def posted(self):
        """A nonblocking collective was started (entered, not blocked in)."""
        with self._lock:
            self.entered += 1

    def waiting(self, what):
        """Within: blocked on collectives entered earlier (posted())."""
        return self._blocked(what, entering=False)

    @contextlib.contextmanager
    def _blocked(self, what, entering):
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
            if outer:
                self.entered += entering
                self.blocked_in, self.since = what, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if outer:
                    self.blocked_in = None

    def report(self):
        with self._lock:
            blocked = None if self.blocked_in is None else time.monotonic() - self.since
            return {"n": self.entered, "in": self.blocked_in, "for": blocked}


collectives = CollectiveTracker()


class Watchdog:
    """Started collectively over `comm` (MPI_COMM_WORLD's ranks); close() when the job's
    collectives are done, abandon() after an error (both say goodbye, so rank 0 does not
    report this rank lost)."""

    def __init__(self, comm, stall_timeout):
        self.comm, self.stall_timeout = comm, stall_timeout
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.interval = min(HEARTBEAT_S, max(stall_timeout / 4, 0.05))
        self._stop = threading.Event()
        self._wake, self._waker = socket.socketpair()     # ends the thread's wait at close()
        self._peers = {}          # rank 0: {rank: _Peer}; elsewhere {0: _Peer}
        self._thread = None
        listener = None
        if self.rank == 0:
            listener = socket.create_server(("", 0), backlog=min(self.world, 4096))
            _raise_file_limit(self.world + 64)
            rendezvous = (_addresses(), listener.getsockname()[1], secrets.token_hex(16),
                          socket.gethostname(), os.getpid())
        else:
            rendezvous = None
        rendezvous = comm.bcast(rendezvous, root=0)
        if self.rank == 0:
            linked = self._accept(listener, rendezvous[2])
        else:
            linked = self._connect(*rendezvous)
        everyone = comm.allreduce(1 if linked else 0, op=runtime.mpi().MIN)
        if not everyone:
            missing = sorted(set(range(1, self.world)) - set(self._peers)) if self.rank == 0 \
                else []
            for sock in [p.sock for p in self._peers.values()] + [self._wake, self._waker]:
                sock.close()
            self._peers = {}
            if self.rank == 0:
                print(f"dynar: warning: watchdog off: rank(s) {_ranks(missing)} could not "
                      f"reach rank 0 ({rendezvous[3]}, TCP port {rendezvous[1]}); lost and "
                      f"stalled ranks will not be detected (--stall-timeout 0 skips this)",
                      file=sys.stderr, flush=True)
            return
        self._thread = threading.Thread(target=self._run, name="dynar-watchdog", daemon=True)
        self._thread.start()

    # -- start-up -------------------------------------------------------------------------

    def _accept(self, listener, token):
        listener.settimeout(1.0)
        deadline = time.monotonic() + CONNECT_BUDGET_S + 10
        while len(self._peers) < self.world - 1 and time.monotonic() < deadline:
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(5.0)
            try:
                hello = json.loads(sock.makefile("r").readline())
                if hello.get("token") != token or not 0 < int(hello["rank"]) < self.world:
                    raise ValueError("not one of this job's ranks")
                sock.sendall(b'{"welcome": true}\n')
            except (OSError, ValueError, KeyError, TypeError):
                sock.close()
                continue
            sock.setblocking(False)
            self._peers[int(hello["rank"])] = _Peer(sock, hello.get("host"), hello.get("pid"))
        listener.close()
        return len(self._peers) == self.world - 1

    def _connect(self, addresses, port, token, host, pid):
        # Same host as rank 0: loopback first (its other addresses may be filtered).
        if host == socket.gethostname():
            addresses = ["127.0.0.1"] + [a for a in addresses if a != "127.0.0.1"]
        deadline = time.monotonic() + CONNECT_BUDGET_S
        for address in addresses:
            timeout = min(3.0, deadline - time.monotonic())
            if timeout <= 0:
                break
            sock = None
            try:
                sock = socket.create_connection((address, port), timeout=timeout)
                sock.sendall(json.dumps({"token": token, "rank": self.rank, "pid": os.getpid(),
                                         "host": socket.gethostname()}).encode() + b"\n")
                if not json.loads(sock.makefile("r").readline()).get("welcome"):
                    raise ValueError("refused")
            except (OSError, ValueError, AttributeError):
                if sock is not None:
                    sock.close()
                continue
            sock.setblocking(False)
            self._peers[0] = _Peer(sock, host, pid)
            return True
        return False

    # -- running --------------------------------------------------------------------------

    def _run(self):
        selector = selectors.DefaultSelector()
        for rank, peer in self._peers.items():
            selector.register(peer.sock, selectors.EVENT_READ, rank)
        selector.register(self._wake, selectors.EVENT_READ, None)
        me = _Peer(None, socket.gethostname(), os.getpid())
        warned_at, beat = 0.0, time.monotonic()
        for peer in self._peers.values():      # the start-up took its time: count from now
            peer.heard = beat
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(max(beat - time.monotonic(), 0)):
                    if key.data is None:
                        break
                    rank, peer = key.data, self._peers[key.data]
                    for message in peer.receive():
                        self._heard(rank, peer, message)
                    if peer.closed:
                        selector.unregister(peer.sock)
                        if not peer.left:
                            self._lost(rank, peer)
                now = time.monotonic()
                if now < beat:
                    continue
                if now - beat > 3 * self.interval:
                    # This process was frozen itself (SIGSTOP, a suspended VM): the silence
                    # it sees is its own, so it judges nobody by it.
                    for peer in self._peers.values():
                        peer.heard = now
                beat = now + self.interval
                me.state, me.heard = collectives.report(), now
                self._send_all({"hb": me.state})
                if self.stall_timeout > 0:
                    warned_at = self._check_stall(me, warned_at)
        except Exception as exc:  # noqa: BLE001 - a broken watchdog must not go unnoticed
            print(f"[rank {self.rank}] dynar: warning: watchdog stopped ({exc})",
                  file=sys.stderr, flush=True)

    def _heard(self, rank, peer, message):
        if "abort" in message and rank == 0:
            runtime.end_job(None)             # rank 0 has said why
        if message.get("bye"):
            peer.left = message.get("why", "finished")
        if "hb" in message:
            peer.state = message["hb"]

    def _lost(self, rank, peer):
        why = f"lost rank {rank} ({peer.where}): its process ended without leaving the job " \
              f"(killed, or its node failed)"
        self._send_all({"abort": why})
        runtime.end_job(f"[rank {self.rank}] dynar: {why}")

    def _check_stall(self, me, warned_at):
        now, limit = time.monotonic(), self.stall_timeout
        ranks = {**self._peers, self.rank: me}
        if self.rank != 0:
            blocked = me.blocked(now) or 0
            rank0 = self._peers[0]
            gone = (f"has left the job ({rank0.left})" if rank0.left == "error" else
                    f"has sent nothing for {now - rank0.heard:.0f} s (stopped, or its node is "
                    f"down)" if now - rank0.heard >= limit and not rank0.left else None)
            if blocked >= limit and gone:
                runtime.end_job(f"[rank {self.rank}] dynar: stall: this rank waited "
                                f"{blocked:.0f} s in {me.state['in']} for rank 0 "
                                f"({rank0.where}), which {gone} (--stall-timeout {limit:g})")
            return warned_at
        # A silent rank's last report says nothing about now: it is not among the waiting.
        silent = {r for r, p in ranks.items() if now - p.heard >= limit}
        waiting = [r for r, p in ranks.items()
                   if r not in silent and (p.blocked(now) or 0) >= limit]
        if not waiting:
            return warned_at
        target = max(ranks[r].state["n"] for r in waiting)
        behind = {r: p for r, p in ranks.items()
                  if p.state["n"] < target or r in silent or p.left}
        if behind:
            first = max(waiting, key=lambda r: ranks[r].blocked(now))
            why = (f"stall: rank(s) {_ranks(waiting)} waited {ranks[first].blocked(now):.0f} s "
                   f"in {ranks[first].state['in']} for "
                   + "; ".join(f"rank {r} ({p.where}), which {p.lag(now, target)}"
                               for r, p in sorted(behind.items()))
                   + f" (--stall-timeout {limit:g})")
            self._send_all({"abort": why})
            runtime.end_job(f"[rank 0] dynar: {why}")
        if now - warned_at >= limit:
            print(f"[rank 0] dynar: warning: every rank has been in "
                  f"{ranks[waiting[0]].state['in']} for over {limit:g} s (a slow network, or "
                  f"MPI itself is stuck)", file=sys.stderr, flush=True)
            return now
        return warned_at

    def _send_all(self, message):
        data = json.dumps(message).encode() + b"\n"
        for peer in self._peers.values():
            peer.send(data)

    # -- leaving --------------------------------------------------------------------------

    def close(self, why="finished"):
        """Say goodbye to rank 0 (rank 0: to everyone) and stop the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._waker.send(b"x")
        self._thread.join()
        self._thread = None
        self._send_all({"bye": True, "why": why})
        for sock in [p.sock for p in self._peers.values()] + [self._wake, self._waker]:
            sock.close()

    def abandon(self):
        self.close("error")


class _Peer:
    def __init__(self, sock, host, pid):
        self.sock, self.host, self.pid = sock, host, pid
        self.state = {"n": 0, "in": None, "for": None}
        self.heard = time.monotonic()      # when its last message came
        self.left = None                   # why it said goodbye
        self.closed = False
        self._partial = b""

    @property
    def where(self):
        return f"host {self.host}, pid {self.pid}"

    def blocked(self, now):
        """Seconds it has been blocked in a collective by now, or None."""
        return None if self.state["for"] is None else self.state["for"] + now - self.heard

    def lag(self, now, target):
        """Why this rank is not where the waiting ones are, in words."""
        if self.left:
            return f"has left the job ({self.left})"
        if now - self.heard >= 2 * HEARTBEAT_S + 1:
            return f"has sent nothing for {now - self.heard:.0f} s (stopped, or its node is down)"
        where = f"blocked in {self.state['in']}" if self.state["in"] else "computing"
        return f"did not arrive ({target - self.state['n']} collective(s) behind, {where})"

    def receive(self):
        """The complete messages that have arrived; sets `closed` at the end of the stream."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return []
        self.heard = time.monotonic()
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        messages = []
        for line in lines:
            try:
                messages.append(json.loads(line))
            except ValueError:
                continue
        return messages

    def send(self, data):
        # Non-blocking: a peer that reads nothing (stopped) must not stop this thread; its
        # heartbeats are simply dropped once its socket buffer is full.
        try:
            self.sock.send(data)
        except OSError:
            pass


def _ranks(ranks):
    return ", ".join(map(str, ranks)) or "none"


def _addresses():
    """This host's IPv4 addresses, loopback last."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,     # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        found.append(socket.inet_ntoa(packed[20:24]))
    found.sort(key=lambda a: a.startswith("127."))
    return found or ["127.0.0.1"]


def _raise_file_limit(needed):
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    except (ImportError, ValueError, OSError):
        pass
