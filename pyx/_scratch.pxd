# Scratch memory that outlives a kernel call.
#
# Kernels that need workspace (conv's im2col tiles and per-thread weight-gradient partials)
# keep one module-level Scratch and reuse it call after call: a fresh multi-megabyte malloc
# per call comes back from the OS as new pages that the kernel must zero first, which cost
# 8% of a VGG training step. The buffer only grows. Take and give run with the GIL held, so
# `busy` needs no lock; a second Python thread calling while the buffer is in use gets a
# private malloc instead of waiting.
#
# Every workspace allocation is reported to tracemalloc (domain WORKSPACE_DOMAIN, as numpy
# reports its arrays), so Python's own tools see kernel memory too and a test can show that a
# steady-state training step allocates nothing.
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc

cdef extern from "Python.h":
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size) nogil
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr) nogil

# "dyn" in ASCII: the tracemalloc domain of dynar's kernel workspace.
cdef enum:
    WORKSPACE_DOMAIN = 0x64796e


cdef inline void* _tracked_malloc(size_t nbytes) noexcept:
    cdef void* p = malloc(nbytes if nbytes > 0 else 1)
    if p != NULL:
        PyTraceMalloc_Track(WORKSPACE_DOMAIN, <uintptr_t> p, nbytes)
    return p


cdef inline void _tracked_free(void* p) noexcept:
    if p != NULL:
        PyTraceMalloc_Untrack(WORKSPACE_DOMAIN, <uintptr_t> p)
        free(p)


cdef struct Scratch:
    void* ptr
    size_t size
    bint busy


cdef inline void* scratch_take(Scratch* s, size_t nbytes, bint* private) except NULL:
    """nbytes of memory; *private tells scratch_give whether it must be freed."""
    cdef void* p
    if not s.busy:
        if s.size < nbytes:
            _tracked_free(s.ptr)
            s.ptr = _tracked_malloc(nbytes)
            s.size = nbytes if s.ptr != NULL else 0
        if s.ptr != NULL:
            s.busy = True
            private[0] = False
            return s.ptr
    p = _tracked_malloc(nbytes)
    if p == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes of kernel workspace")
    private[0] = True
    return p


cdef inline void scratch_give(Scratch* s, void* p, bint private) noexcept:
    if private:
        _tracked_free(p)
    else:
        s.busy = False
