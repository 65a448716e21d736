# Scratch memory that outlives a kernel call.
#
# A kernel that needs workspace takes it from a Scratch kept at module level and gives it back
# before returning, so one buffer serves call after call: a fresh multi-megabyte malloc per
# call comes back from the OS as new pages that the kernel must fault in and zero first
# (docs/notes/2026-12-02-kernels.md). The buffer only grows until released (kernel tuning
# calls conv.release_workspace). Take and give run with the GIL held, so `busy` needs no
# lock; a second Python thread calling while the buffer is in use gets a private allocation
# instead of waiting.
#
# Every workspace allocation is reported to tracemalloc (domain WORKSPACE_DOMAIN, as numpy
# reports its arrays), so Python's own tools see kernel memory too and a test can show that a
# steady-state training step allocates nothing.
#
# A large buffer is a memory mapping of its own, as the step arena's large arrays are
# (nn/arena.py, mapped_empty): each block malloc frees raises its mmap threshold, after
# which the heap keeps what a training step frees (kernel tuning releases the buffer after
# every candidate).
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void** ptr, size_t alignment, size_t size)

cdef extern from "Python.h":
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size) nogil
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr) nogil

cdef enum:
    # "dyn" in ASCII: the tracemalloc domain of dynar's kernel workspace.
    WORKSPACE_DOMAIN = 0x64796e
    # Workspace starts on a cache line, so a kernel that lays its buffers out on vector
    # boundaries from there never has a vector load or store straddle two lines.
    WORKSPACE_ALIGN = 64
    # Buffers from this size up are mappings of their own (as nn/arena.py's arrays).
    OWN_MAPPING_BYTES = 1 << 20


# A buffer starts WORKSPACE_ALIGN bytes into its block, whose first word holds the bytes
# asked for: that says how the block was made, and a mapping's length.
cdef inline void* _tracked_malloc(size_t nbytes) noexcept:
    cdef void* block = NULL
    cdef size_t total = nbytes + WORKSPACE_ALIGN
    if total < nbytes:    # a size past the address space (from a caller's overflow)
        return NULL
    if nbytes >= OWN_MAPPING_BYTES:
        block = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if block == MAP_FAILED:
            return NULL
    elif posix_memalign(&block, WORKSPACE_ALIGN, total) != 0:
        return NULL
    (<size_t*> block)[0] = nbytes
    cdef void* p = <char*> block + WORKSPACE_ALIGN
    PyTraceMalloc_Track(WORKSPACE_DOMAIN, <uintptr_t> p, nbytes)
    return p


cdef inline void _tracked_free(void* p) noexcept:
    if p == NULL:
        return
    PyTraceMalloc_Untrack(WORKSPACE_DOMAIN, <uintptr_t> p)
    cdef void* block = <char*> p - WORKSPACE_ALIGN
    cdef size_t nbytes = (<size_t*> block)[0]
    if nbytes >= OWN_MAPPING_BYTES:
        munmap(block, nbytes + WORKSPACE_ALIGN)
    else:
        free(block)


cdef struct Scratch:
    void* ptr
    size_t size
    bint busy


cdef inline void* scratch_take(Scratch* s, size_t nbytes, bint* private) except NULL:
    """nbytes of memory starting on a cache line; *private tells scratch_give whether it
    must be freed."""
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


cdef inline int scratch_release(Scratch* s, str what) except -1:
    """Frees s's buffer (the next take grows it again); RuntimeError while a call holds it."""
    if s.busy:
        raise RuntimeError(f"the {what} workspace is in use")
    _tracked_free(s.ptr)
    s.ptr = NULL
    s.size = 0
    return 0
