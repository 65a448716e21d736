"""Allreduce of gradient buffers, calling MPI directly (mpi4py's libmpi declarations).

Every call releases the GIL for the whole MPI operation, so Python threads keep running.
`allreduce_mean` is blocking (MPI_Allreduce: the MPI library's tuned algorithms, meant for a
communication thread); `start_mean` is nonblocking (MPI_Iallreduce) and returns a
`Pending`, whose `test()` drives progress without blocking and `wait()` blocks. On
completion the buffer holds the mean over ranks: the sum, then one fused scaling pass by
1/size. MPI's own reduction leaves identical bytes on every rank.
"""
from libc.stdlib cimport malloc, free
cimport numpy as cnp

from mpi4py.libmpi cimport (MPI_Comm, MPI_Request, MPI_Datatype, MPI_FLOAT, MPI_DOUBLE,
                            MPI_SUM, MPI_IN_PLACE, MPI_STATUSES_IGNORE, MPI_SUCCESS,
                            MPI_Allreduce, MPI_Comm_size, MPI_Iallreduce, MPI_Testall, MPI_Waitall)
from mpi4py.MPI cimport Comm

from _validate cimport F32, FloatKind, check_float, data, float_kind

cnp.import_array()

cdef extern from "mpi_vendor.h":
    const char* DYNAR_MPI_VENDOR

# MPI counts are C ints: larger buffers are reduced as several requests of at most this.
DEF MAX_PART = 1 << 30
# The blocking allreduce works through a buffer in pieces of this many elements (4 MB of
# float32) and scales each piece while it is still in cache: on shared memory Open MPI
# reduces 93 MB in 25 MB pieces 4x faster than in one call (docs/PERFORMANCE.md).
DEF PIECE = 1 << 20

COMPILED_VENDOR = DYNAR_MPI_VENDOR.decode()


cdef void _scale(void* buf, Py_ssize_t n, FloatKind kind, double factor) noexcept nogil:
    # Serial on purpose: it runs on a piece MPI has just reduced (still in cache), often on
    # the synchronizer's communication thread, where an OpenMP team of its own would compete
    # with the compute threads for the cores.
    cdef Py_ssize_t i
    cdef float* f = <float*> buf
    cdef double* d = <double*> buf
    cdef float ff = <float> factor
    if kind == F32:
        for i in range(n):
            f[i] = f[i] * ff
    else:
        for i in range(n):
            d[i] = d[i] * factor


cdef class Pending:
    """An allreduce in flight. The buffer must stay untouched until test() returns True or
    wait() returns; then it holds the mean over the communicator's ranks."""
    cdef MPI_Request* requests
    cdef int count
    cdef object buffer          # keeps the array alive while MPI writes into it
    cdef void* ptr
    cdef Py_ssize_t n
    cdef FloatKind kind
    cdef double factor
    cdef readonly bint done

    def __dealloc__(self):
        # A Pending dropped while in flight would let MPI write into freed memory later;
        # complete it first.
        if self.requests != NULL:
            if not self.done:
                with nogil:
                    MPI_Waitall(self.count, self.requests, MPI_STATUSES_IGNORE)
            free(self.requests)

    cdef void _finish(self) noexcept nogil:
        _scale(self.ptr, self.n, self.kind, self.factor)
        self.done = True

    def test(self):
        """Progress the reduction without blocking; True once complete (and scaled)."""
        cdef int flag = 1
        if self.done:
            return True
        with nogil:
            MPI_Testall(self.count, self.requests, &flag, MPI_STATUSES_IGNORE)
            if flag:
                self._finish()
        return bool(flag)

    def wait(self):
        """Block until the reduction is complete (and scaled)."""
        if self.done:
            return
        with nogil:
            MPI_Waitall(self.count, self.requests, MPI_STATUSES_IGNORE)
            self._finish()


def start_mean(buf, Comm comm not None):
    """Post an in-place allreduce of `buf` (1-D float32/float64, C-contiguous) over `comm`
    and return its Pending; on completion buf holds the mean over ranks."""
    cdef FloatKind kind = float_kind("buf", buf)
    cdef cnp.ndarray a = check_float("buf", buf, 1, kind, output=True)
    cdef Py_ssize_t n = a.shape[0]
    cdef int size = 0
    MPI_Comm_size(comm.ob_mpi, &size)
    cdef Pending p = Pending.__new__(Pending)
    p.buffer = a
    p.ptr = data(a)
    p.n = n
    p.kind = kind
    p.factor = 1.0 / size
    p.count = <int> ((n + MAX_PART - 1) // MAX_PART)
    if p.count == 0:
        p.done = True
        return p
    p.requests = <MPI_Request*> malloc(p.count * sizeof(MPI_Request))
    if p.requests == NULL:
        raise MemoryError("start_mean: cannot allocate MPI requests")
    cdef MPI_Datatype dtype = MPI_FLOAT if kind == F32 else MPI_DOUBLE
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef MPI_Comm c = comm.ob_mpi
    cdef int i, part, err = MPI_SUCCESS
    cdef char* base = <char*> p.ptr
    with nogil:
        for i in range(p.count):
            part = <int> (n - <Py_ssize_t> i * MAX_PART if n - <Py_ssize_t> i * MAX_PART < MAX_PART
                          else MAX_PART)
            err = MPI_Iallreduce(MPI_IN_PLACE, base + <size_t> i * MAX_PART * itemsize, part,
                                 dtype, MPI_SUM, c, &p.requests[i])
            if err != MPI_SUCCESS:
                break
    if err != MPI_SUCCESS:
        p.count = i   # only the posted ones are waited for on deallocation
        raise RuntimeError(f"MPI_Iallreduce failed with error code {err}")
    return p


def allreduce_mean(buf, Comm comm not None):
    """In-place blocking allreduce of `buf` (1-D float32/float64, C-contiguous) over `comm`;
    returns with buf holding the mean over ranks."""
    cdef FloatKind kind = float_kind("buf", buf)
    cdef cnp.ndarray a = check_float("buf", buf, 1, kind, output=True)
    cdef Py_ssize_t n = a.shape[0], done = 0
    cdef int size = 0, part, err = MPI_SUCCESS
    MPI_Comm_size(comm.ob_mpi, &size)
    cdef MPI_Datatype dtype = MPI_FLOAT if kind == F32 else MPI_DOUBLE
    cdef size_t itemsize = 4 if kind == F32 else 8
    cdef MPI_Comm c = comm.ob_mpi
    cdef char* base = <char*> data(a)
    with nogil:
        while done < n and err == MPI_SUCCESS:
            part = <int> (n - done if n - done < PIECE else PIECE)
            err = MPI_Allreduce(MPI_IN_PLACE, base + <size_t> done * itemsize, part, dtype,
                                MPI_SUM, c)
            if err == MPI_SUCCESS:
                _scale(base + <size_t> done * itemsize, part, kind, 1.0 / size)
            done += part
    if err != MPI_SUCCESS:
        raise RuntimeError(f"MPI_Allreduce failed with error code {err}")
