"""The folder a run writes its checkpoints into (--checkpoint-dir), and its rules.

- One job at a time: the folder's lock file is held (flock) for as long as the run lives and
  names its holder (host, pid); a second job is refused with that name. The lock dies with
  the process, so a killed or requeued job never leaves the folder locked.
- Temporaries a killed writer left behind (dynar/atomic_write.py's hidden *.tmp) are
  removed when the folder is taken.
- Order is the checkpoints' own: their global step, read from each file. `--resume auto`
  takes the newest that loads; a corrupt one is set aside as NAME.corrupt with a warning and
  the previous one taken. A run that starts behind the newest (a fresh start, or an older
  checkpoint resumed) sets the newer ones aside as NAME.superseded: they continue another
  run, and --resume auto must not return to them.
- `--keep-last K` deletes all but the K newest after each save, never the one just written.
Only rank 0 holds a CheckpointDir; resume_point() and save_across_ranks() are how the other
ranks take part (Job.from_rank0).
"""
import errno
import fcntl
import os
import re
import socket
import sys
import time

from .. import checkpoint
from ..dist.job import CollectiveError
from ..dist.watchdog import collectives
from ..kernels.sgd import all_finite
from .state import require_writable, resume_path

LOCK_NAME = ".lock"
LAST = "last.ckpt"
_TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")    # atomic_write's names
# Filesystems without working locks (Lustre mounted without -o flock, some NFS setups).
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class CheckpointDirInUse(ValueError):
    """Another live process holds the folder."""


class CheckpointWriteError(CollectiveError):
    """A checkpoint could not be written (or would hold non-finite values); the earlier ones
    are as they were."""


def warn(message):
    print(f"dynar: warning: {message}", file=sys.stderr, flush=True)


class CheckpointDir:
    """`folder`, created if needed, checked writable and locked for this process (the
    `flag` names it in errors); keep_last: how many checkpoints to keep (None: all)."""

    def __init__(self, folder, keep_last=None, flag="--checkpoint-dir"):
        self.folder, self.keep_last = folder, keep_last
        require_writable(folder, flag)
        self._lock = self._take_lock(flag)
        self._remove_temporaries()

    def _take_lock(self, flag):
        path = os.path.join(self.folder, LOCK_NAME)
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not written its name yet"
            lock.close()
            raise CheckpointDirInUse(f"{flag} {self.folder}: in use by another job ({holder}; "
                                     f"lock file {path}): give each job its own folder") from None
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            warn(f"{flag} {self.folder}: this filesystem cannot lock files ({exc.strerror}); "
                 f"a second job using the folder at the same time would not be stopped")
        lock.seek(0)
        lock.truncate()
        lock.write(f"host {socket.gethostname()}, pid {os.getpid()}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        return lock

    def _remove_temporaries(self):
        stale = [name for name in os.listdir(self.folder) if _TEMPORARY.match(name)]
        for name in stale:
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass
        if stale:
            warn(f"{self.folder}: removed {len(stale)} unfinished checkpoint file(s) a killed "
                 f"writer left behind")

    def close(self):
        """Release the folder (the lock also ends with the process)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # -- what the folder holds ------------------------------------------------------------

    def checkpoints(self):
        """[(global step, path)] of the checkpoints whose position can be read, newest first
        (last.ckpt, a second name of the newest, left out)."""
        found = []
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if not name.endswith(".ckpt") or name == LAST or not os.path.isfile(path):
                continue
            try:
                step = checkpoint.peek(path).get("global_step")
            except checkpoint.CheckpointError:
                continue
            if isinstance(step, int):
                found.append((step, path))
        return sorted(found, reverse=True)

    def newest(self):
        """(path, state) of the newest checkpoint that loads, or None when there is none.
        Each newer one that does not load is set aside as NAME.corrupt, with a warning."""
        candidates = self.checkpoints()
        unreadable = {os.path.join(self.folder, n) for n in os.listdir(self.folder)
                      if n.endswith(".ckpt") and n != LAST} - {p for _, p in candidates}
        for path in sorted(unreadable):
            self._set_aside(path, ".corrupt", "cannot be read")
        for _, path in candidates:
            try:
                state = checkpoint.load(path)
            except checkpoint.CheckpointError as exc:
                self._set_aside(path, ".corrupt", str(exc).split(": ", 1)[-1])
                continue
            checkpoint.link_as_last(path)
            return path, state
        return None

    def start_at(self, global_step):
        """A run continues from `global_step`: newer checkpoints belong to another run and
        are set aside as NAME.superseded."""
        newer = [path for step, path in self.checkpoints() if step > global_step]
        for path in newer:
            os.replace(path, path + ".superseded")
        if newer:
            warn(f"{self.folder}: this run starts at step {global_step}; {len(newer)} newer "
                 f"checkpoint(s) of another run set aside as *.ckpt.superseded")
        last = os.path.join(self.folder, LAST)
        if newer and os.path.exists(last) and not any(
                os.path.samefile(last, p) for _, p in self.checkpoints()):
            os.unlink(last)

    def _set_aside(self, path, suffix, why):
        os.replace(path, path + suffix)
        warn(f"{path}: {why}; set aside as {os.path.basename(path)}{suffix}, taking the "
             f"previous checkpoint")

    # -- writing --------------------------------------------------------------------------

    def save(self, name, state):
        """Write `state` as `name`, make it last.ckpt, then prune to keep_last. Returns the
        path. An OSError leaves every earlier checkpoint as it was."""
        path = os.path.join(self.folder, name)
        checkpoint.save(path, state)
        checkpoint.link_as_last(path)
        if self.keep_last is not None:
            for _, old in self.checkpoints()[self.keep_last:]:
                if not os.path.samefile(old, path):
                    os.unlink(old)
        return path


# -- across ranks ---------------------------------------------------------------------------

def resume_point(job, folder, resume):
    """(path, state) of the checkpoint every rank of `job` continues from, or None: rank 0
    loads `resume` (a file, a folder's last.ckpt, or "auto": `folder`'s newest that loads)
    and hands it to all, so that all continue from the same one. Collective."""
    def find():
        if resume == "auto":
            return folder.newest()
        if resume:
            path = resume_path(resume)
            return path, checkpoint.load(path)
        return None
    return job.from_rank0(find)


def save_across_ranks(job, folder, run, kind):
    """Collective: rank 0 writes `run` (a state.Run) into `folder` (its CheckpointDir), named
    by its epoch (`kind` "epoch") or its step, once every rank has checked that the model
    and the velocity (identical on every rank) are finite. Returns rank 0's path on every
    rank; a failure is the same CheckpointWriteError on every rank."""
    at = run.position
    name = f"epoch_{at.epoch:04d}.ckpt" if kind == "epoch" else f"step_{at.global_step:07d}.ckpt"
    arrays = [run.model.flat_params, run.optimizer.momentum_buffer] + [
        b for _, b in run.model.named_buffers()]
    if not all(all_finite(a.reshape(-1)) for a in arrays
               if a is not None and a.dtype.kind == "f"):
        raise CheckpointWriteError(f"step {at.global_step}: the model holds non-finite "
                                   f"values; checkpoint {name} not written")

    def write():
        try:
            return folder.save(name, run.state())
        except OSError as exc:
            raise CheckpointWriteError(f"cannot write checkpoint "
                                       f"{os.path.join(folder.folder, name)}: "
                                       f"{exc.strerror or exc}; the earlier checkpoints are "
                                       f"kept") from None
    with collectives.inside("writing a checkpoint"):     # rank 0 writes, the others wait
        return job.from_rank0(write)
