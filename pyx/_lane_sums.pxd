# Long sums in lanes: BatchNorm's statistics and the convolutions' bias gradients.
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
    """acc[:count] = 0 (count doubles: LANES per sum)."""
    cdef Py_ssize_t l
    for l in range(count):
        acc[l] = 0


cdef inline void lanes_add(double* acc, const floating* run, Py_ssize_t length) noexcept nogil:
    """acc[i % LANES] += run[i] for i < length: one run of a lane sum."""
    # Summed in a local copy, which can stay in registers for the whole run whatever the
    # compiler proves about `acc` (it may alias `run` in the float64 instantiation).
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


# Channel sums of an NCHW batch in blocks of channels. A channel alone is N runs of H W
# values, too short for the hardware prefetchers once H W is small (8x8: 256 bytes a run);
# a block's part of each image is one run of (block channels) x H W values. Each channel is
# still added in runs_sum's order for it alone, so blocks never change a result.

cdef enum:
    BLOCK_VALUES = 1024     # values a block aims to read per image: 4 KiB of float32
    MAX_BLOCK = 64          # channels a block takes at most: its lane sums live on the stack


cdef inline Py_ssize_t channel_block(Py_ssize_t C, Py_ssize_t HW,
                                     Py_ssize_t threads) noexcept nogil:
    """Channels per block: about BLOCK_VALUES values an image, but no block larger than a
    thread's share of the channels."""
    cdef Py_ssize_t block = BLOCK_VALUES // HW
    if block > MAX_BLOCK:
        block = MAX_BLOCK
    if block > (C + threads - 1) // threads:
        block = (C + threads - 1) // threads
    return block if block > 1 else 1


cdef inline void channel_sums(double* sums, const floating* a, Py_ssize_t c0, Py_ssize_t c1,
                              Py_ssize_t N, Py_ssize_t C, Py_ssize_t HW) noexcept nogil:
    """sums[c - c0] = the sum of channel c of a (N, C, HW) over (N, HW), for the block
    c0 <= c < c1 (at most MAX_BLOCK channels)."""
    cdef double acc[MAX_BLOCK * LANES]
    cdef Py_ssize_t n, c
    lanes_zero(acc, (c1 - c0) * LANES)
    for n in range(N):
        for c in range(c0, c1):
            lanes_add(acc + (c - c0) * LANES, a + (n * C + c) * HW, HW)
    for c in range(c1 - c0):
        sums[c] = lanes_total(acc + c * LANES)
