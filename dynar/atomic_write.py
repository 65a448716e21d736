"""Replacing a file atomically: readers (other ranks, other jobs, a resumed run) see the old
file or the new one, never half of one, and a failed write leaves no temporary behind.

Every file dynar writes for later reading goes through here: checkpoints, tuning files,
traces and perf results."""
import os
import secrets


def replace_atomically(target, fill):
    """target becomes the file fill(tmp) creates at a fresh hidden name beside it, or stays as
    it was: the temporary is renamed over target (same filesystem, so atomic) and the folder
    fsync'ed so the rename survives a crash. fill must create tmp (open it "x") and should
    fsync what it wrote. If anything fails, the temporary is removed."""
    target = os.fspath(target)
    folder = os.path.dirname(os.path.abspath(target))
    tmp = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}."
                               f"{secrets.token_hex(4)}.tmp")
    try:
        fill(tmp)
        os.replace(tmp, target)
    except BaseException:
        # Also on KeyboardInterrupt: never leave the half-written temporary behind.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)


def write_text(target, text):
    """replace_atomically with a text file holding `text` (UTF-8)."""
    write_binary(target, lambda f: f.write(text.encode("utf-8")))


def write_binary(target, write):
    """replace_atomically with the binary file write(f) writes (f open for writing)."""
    def fill(tmp):
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    replace_atomically(target, fill)


def _fsync_dir(folder):
    """Persist the directory entry of a rename (POSIX; Windows cannot open directories)."""
    # Where that is impossible the rename has still happened; only its durability across a
    # power loss is weaker, which is no reason to fail a save that succeeded.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
