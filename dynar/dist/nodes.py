"""Which ranks share a node: the one place a communicator is split by node, for the default
thread count (runtime.node_layout) and for the allreduce's shared-memory stage (Collective)."""
import os


def env_node_key():
    """DYNAR_NODE_KEY as an int, or None. A test and emulation override: ranks with equal
    keys form one "node" instead of the ranks that share memory."""
    key = os.environ.get("DYNAR_NODE_KEY")
    return None if key is None else int(key)


def split_by_node(comm, node_key=None):
    """The ranks of `comm` on this rank's node, in their order: MPI_Comm_split_type(SHARED),
    or the ranks with the same node_key."""
    from mpi4py import MPI
    if node_key is None:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    return comm.Split(color=int(node_key), key=comm.Get_rank())
