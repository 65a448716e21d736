"""dynar's allreduce algorithms over one communicator, by name.

The extension (pyx/allreduce.pyx) takes ids and communicators; this is where names become
ids and the node's ranks are found. Creating a Collective loads MPI (dist/runtime.py)."""
from . import nodes, runtime
from .algorithms import algorithm_id
from .wire import wire_id


class Collective:
    """Allreduce-mean over `comm` (collective to create). Nodes are the ranks that share
    memory, or the ranks with equal `node_key` (default: DYNAR_NODE_KEY, the emulation and
    test override; such ranks must still share memory).

    allreduce_mean(buf, algorithm, wire, threads) reduces `buf` (1-D float32/float64,
    C-contiguous) in place to the mean over ranks; every rank must make the same calls in
    the same order. Only one thread may use a Collective at a time (MPI_THREAD_SERIALIZED).
    free() (collective) releases its communicators."""

    def __init__(self, comm, reduce_threads=1, node_key=None):
        ext = runtime.allreduce()
        node_key = nodes.env_node_key() if node_key is None else node_key
        local = nodes.split_by_node(comm, node_key)
        try:
            self._ext = ext.Collective(comm, local, reduce_threads)
        finally:
            local.Free()            # the extension keeps a duplicate

    def allreduce_mean(self, buf, algorithm="mpi", wire=None, threads=None):
        """`buf` becomes the mean over ranks, reduced by `algorithm` (dist/algorithms.py),
        with 16-bit values on the wire if `wire` names a format (ring only), summing large
        chunks on `threads` threads (default reduce_threads; 1 beside busy compute threads)."""
        self._ext.allreduce_mean(buf, algorithm_id(algorithm), wire_id(wire), threads)

    @property
    def comm_handle(self):
        """The private duplicate communicator (mpi4py), for small collectives of the caller's
        own between allreduces (tuning, agreeing on timings)."""
        return self._ext.comm_handle

    rank = property(lambda self: self._ext.rank)
    size = property(lambda self: self._ext.size)
    local_rank = property(lambda self: self._ext.local_rank)
    local_size = property(lambda self: self._ext.local_size)
    nodes = property(lambda self: self._ext.nodes, doc="the number of nodes")

    @property
    def reduce_threads(self):
        return self._ext.reduce_threads

    def free(self):
        """Release the communicators and the shared window (collective)."""
        self._ext.free()


def compress_with_feedback(grad, residual, wire):
    """Error-feedback rounding of one rank's gradient to `wire` ("fp16"/"bf16"), in place:
    grad <- round(grad + residual), residual <- what the rounding dropped."""
    runtime.allreduce().compress_with_feedback(grad, residual, wire_id(wire))
