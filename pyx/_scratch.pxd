# Scratch memory that outlives a kernel call.
#
# Kernels that need workspace (conv's im2col tiles and per-thread weight-gradient partials)
# keep one module-level Scratch and reuse it call after call: a fresh multi-megabyte malloc
# per call comes back from the OS as new pages that the kernel must zero first, which cost
# 8% of a VGG training step. The buffer only grows. Take and give run with the GIL held, so
# `busy` needs no lock; a second Python thread calling while the buffer is in use gets a
# private malloc instead of waiting.
from libc.stdlib cimport free, malloc


cdef struct Scratch:
    void* ptr
    size_t size
    bint busy


cdef inline void* scratch_take(Scratch* s, size_t nbytes, bint* private) except NULL:
    """nbytes of memory; *private tells scratch_give whether it must be freed."""
    cdef void* p
    if not s.busy:
        if s.size < nbytes:
            free(s.ptr)
            s.ptr = malloc(nbytes)
            s.size = nbytes if s.ptr != NULL else 0
        if s.ptr != NULL:
            s.busy = True
            private[0] = False
            return s.ptr
    p = malloc(nbytes if nbytes > 0 else 1)
    if p == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes of kernel workspace")
    private[0] = True
    return p


cdef inline void scratch_give(Scratch* s, void* p, bint private) noexcept:
    if private:
        free(p)
    else:
        s.busy = False
