# Long sums in lanes: BatchNorm's statistics and every layer's bias gradient.
#
# One running sum waits on its last add and keeps the core at a fraction of its add rate
# (and a float32 one loses digits over a batch of activations). These run LANES independent
# double sums, element i of a run into lane i % LANES, added pairwise at the end: the order
# is fixed by the data's shape alone, so thread and rank counts do not change the result.
from cython cimport floating


cdef enum:
    LANES = 16


cdef inline double lanes_total(double* acc) noexcept nogil:
    """The lanes' sum, pairwise in a fixed order (acc is used up)."""
    cdef Py_ssize_t l, width = LANES
    while width > 1:
        width //= 2
        for l in range(width):
            acc[l] = acc[l] + acc[l + width]
    return acc[0]


cdef inline void lanes_zero(double* acc, Py_ssize_t count) noexcept nogil:
    cdef Py_ssize_t l
    for l in range(count):
        acc[l] = 0


cdef inline void lanes_add(double* acc, const floating* run, Py_ssize_t length) noexcept nogil:
    """acc[i % LANES] += run[i] for i < length: one run of a lane sum."""
    # Summed in a local copy: extension modules build with -fno-strict-aliasing, so through
    # `acc` itself every add would be stored and reloaded in case acc overlapped `run`.
    cdef double lane[LANES]
    cdef Py_ssize_t i, l, whole = length - length % LANES
    for l in range(LANES):
        lane[l] = acc[l]
    for i in range(whole // LANES):
        for l in range(LANES):
            lane[l] = lane[l] + run[i * LANES + l]
    for l in range(length - whole):
        lane[l] = lane[l] + run[whole + l]
    for l in range(LANES):
        acc[l] = lane[l]


cdef inline double runs_sum(const floating* a, Py_ssize_t runs, Py_ssize_t stride,
                            Py_ssize_t length) noexcept nogil:
    """The sum of a[n * stride + i] over n < runs and i < length: `runs` runs of `length`
    adjacent values (a channel of an NCHW batch: runs = N, stride = C H W, length = H W)."""
    cdef double acc[LANES]
    cdef Py_ssize_t n
    lanes_zero(acc, LANES)
    for n in range(runs):
        lanes_add(acc, a + n * stride, length)
    return lanes_total(acc)
