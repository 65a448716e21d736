# OpenMP helpers shared by the kernels (as scikit-learn's _openmp_helpers.pxd).
cimport openmp


cdef inline int threads_for(Py_ssize_t work_items) noexcept nogil:
    """Threads for a prange over `work_items` independent items: the configured count
    (dynar.kernels.set_num_threads), but no more threads than items."""
    cdef int threads = openmp.omp_get_max_threads()
    if work_items < 1:
        return 1
    return <int> work_items if work_items < threads else threads
