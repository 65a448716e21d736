"""Allreduce of gradient buffers, calling MPI directly (mpi4py's libmpi declarations).

`Collective` owns the communicators one job reduces over (a private duplicate of the job's
communicator, the ranks of this node, the node leaders) and runs one of five algorithms on
a buffer, in place, leaving the mean over ranks:

  mpi                 the MPI library's MPI_Allreduce (its own tuned choice), in 4 MB pieces
  ring                reduce-scatter + allgather around a ring: every rank sends 2(p-1)/p of
                      the buffer, the bandwidth lower bound; each step is cut into segments so
                      summing one segment overlaps receiving the next
  recursive_doubling  log2(p) full-buffer exchanges: fewest message start-ups, for small buffers
  rabenseifner        recursive-halving reduce-scatter + recursive-doubling allgather:
                      log-many start-ups and the ring's byte count
  hierarchical        ranks of one node sum through an MPI-3 shared-memory window, each rank
                      summing its own slice (all the node's cores work at once), node leaders
                      ring-allreduce among nodes, every rank copies the result out

Non-power-of-two rank counts fold the extra ranks in first and out last. Every algorithm
leaves identical bytes on every rank: each element's final value is computed by one rank
and copied to the others, or (recursive doubling) by commutative pairwise sums that both
partners evaluate bitwise alike. Scaling by 1/p is fused into the last summing pass.

The calls block with the GIL released: dynar's synchronizer runs them on its communication
thread, so for the training thread they are nonblocking. Only one thread may use a
Collective at a time (MPI_THREAD_SERIALIZED). `start_mean` posts MPI_Iallreduce instead, for
MPI libraries without thread support (progress by Pending.test() calls).

Ring allreduce can carry fp16 or bf16 on the wire (`wire=`), summing in float32: half the
bytes, at the cost of rounding each partial result; `compress_with_feedback` rounds a rank's
own contribution first and keeps the rounding error for the next step (error feedback). What
travels is a running mean, never a running sum: a sum of p values within fp16's range can
leave it (65504), a mean of them cannot; and a contribution beyond the range is sent as the
largest finite value, the excess kept in the residual.
"""
from libc.math cimport isfinite
from libc.stdint cimport uint16_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy
from cython.parallel cimport prange
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, nanosleep, timespec
cimport numpy as cnp

from mpi4py.libmpi cimport (MPI_Aint, MPI_Comm, MPI_COMM_NULL, MPI_Datatype, MPI_DOUBLE,
                            MPI_Error_string, MPI_FLOAT, MPI_IN_PLACE, MPI_INFO_NULL,
                            MPI_MAX_ERROR_STRING, MPI_MODE_NOCHECK,
                            MPI_PROC_NULL, MPI_Request, MPI_STATUS_IGNORE, MPI_STATUSES_IGNORE,
                            MPI_SUCCESS, MPI_SUM, MPI_UINT16_T, MPI_Win, MPI_WIN_NULL,
                            MPI_Allreduce, MPI_Comm_size, MPI_Finalized, MPI_Iallreduce,
                            MPI_Ibarrier, MPI_Irecv, MPI_Isend, MPI_Testall, MPI_Waitall, MPI_Win_allocate_shared, MPI_Win_free,
                            MPI_Win_lock_all, MPI_Win_shared_query, MPI_Win_sync,
                            MPI_Win_unlock_all)
from mpi4py.MPI cimport Comm, Win

from _validate cimport F32, FloatKind, check_float, check_real, data, float_kind

cnp.import_array()

cdef extern from "mpi_vendor.h":
    const char* DYNAR_MPI_VENDOR
    const char* DYNAR_MPI_VERSION

cdef extern from "wire16.h" nogil:
    uint16_t dynar_f32_to_f16(float)
    float dynar_f16_to_f32(uint16_t)
    uint16_t dynar_bf16_from_float(float)
    float dynar_bf16_to_float(uint16_t)

COMPILED_VENDOR = DYNAR_MPI_VENDOR.decode()
COMPILED_VERSION = DYNAR_MPI_VERSION.decode()

# MPI counts are C ints: one message carries at most this many elements.
DEF MAX_PART = 1 << 30
# The MPI algorithm works in pieces of this many elements (4 MB of float32) and scales each
# while it is still in cache: on shared memory Open MPI reduces 93 MB in 25 MB pieces 4x
# faster than in one call (docs/notes/2026-11-30-communication-progress.md).
DEF PIECE = 1 << 20
# Ring steps travel in segments of this many elements, so that summing a received segment
# overlaps the transfer of the next one.
DEF SEGMENT = 1 << 17
# Bytes per rank slot in the hierarchical algorithm's shared window: the buffer goes through
# the node in pieces of this size, so the window stays small and each piece stays in cache.
DEF SHARED_SLOT_BYTES = 1 << 22
# Below this many elements a sum runs on one thread (an OpenMP team costs more than it saves).
DEF PARALLEL_MIN = 1 << 18
DEF TAG = 7401
# Waiting politely: poll MPI for this long, then sleep between polls. A rank that waits for a
# slower peer must not keep a core busy that compute threads (its own, or other ranks' on an
# oversubscribed node) need; the kernel keeps receiving into socket buffers meanwhile.
DEF SPIN_NS = 50000
DEF SLEEP_NS = 20000

# The ids the Python side passes in: dist/algorithms.py and dist/wire.py name them, in
# this order.
cdef enum Algorithm:
    ALG_MPI = 0
    ALG_RING = 1
    ALG_RECURSIVE_DOUBLING = 2
    ALG_RABENSEIFNER = 3
    ALG_HIERARCHICAL = 4
    ALGORITHM_COUNT = 5

cdef enum Wire:
    WIRE_NATIVE = 0
    WIRE_FP16 = 1
    WIRE_BF16 = 2
    WIRE_COUNT = 3

# Returned by the nogil algorithms when malloc fails (MPI error codes are >= 0).
DEF OUT_OF_MEMORY = -1


cdef struct Ctx:
    # One communicator as an algorithm sees it, plus the element type and workspace.
    MPI_Comm comm
    int rank
    int size
    FloatKind kind
    MPI_Datatype dtype
    size_t item
    Wire wire
    int threads
    char* scratch      # receive buffer, sized by the caller for the algorithm
    uint16_t* send16   # wire ring: the segment being sent, narrowed
    uint16_t* all16    # wire ring: the whole buffer in wire format, for the allgather


# ---- elementwise kernels ------------------------------------------------------------------

ctypedef fused real:
    float
    double


cdef void _sum_into(real* dst, const real* src, Py_ssize_t n, real factor,
                    int threads) noexcept nogil:
    # dst = (dst + src) * factor. x * 1 is exact, so one loop serves scaled and plain sums.
    cdef Py_ssize_t i
    if threads > 1 and n >= PARALLEL_MIN:
        # Large chunks (the hierarchical node stage, big ring segments on many-core nodes):
        # memory bandwidth needs several cores.
        for i in prange(n, num_threads=threads, schedule="static"):
            dst[i] = (dst[i] + src[i]) * factor
    else:
        for i in range(n):
            dst[i] = (dst[i] + src[i]) * factor


cdef void _accumulate(Ctx* c, char* dst, const char* src, Py_ssize_t n,
                      double factor) noexcept nogil:
    if c.kind == F32:
        _sum_into(<float*> dst, <const float*> src, n, <float> factor, c.threads)
    else:
        _sum_into(<double*> dst, <const double*> src, n, factor, c.threads)


# Elements summed per block by _sum_sources: the running sum stays in L1 while every source
# streams through it once.
DEF SOURCE_BLOCK = 4096


cdef void _sum_sources(real* dst, const real** src, int count, Py_ssize_t n, real factor,
                       int threads) noexcept nogil:
    # dst = (dst + src[0] + ... + src[count-1]) * factor, added in that order: one pass over
    # memory instead of count, block by block. OpenMP over blocks when n is large.
    cdef Py_ssize_t blocks = (n + SOURCE_BLOCK - 1) // SOURCE_BLOCK, b, lo, m
    cdef int j
    if count == 0:
        for lo in range(n):
            dst[lo] = dst[lo] * factor
        return
    for b in prange(blocks, num_threads=threads if n >= PARALLEL_MIN else 1,
                    schedule="static"):
        lo = b * SOURCE_BLOCK
        m = n - lo if n - lo < SOURCE_BLOCK else SOURCE_BLOCK
        for j in range(count):
            _sum_into(dst + lo, src[j] + lo, m, factor if j == count - 1 else <real> 1, 1)


cdef inline float _widen(Wire wire, uint16_t v) noexcept nogil:
    return dynar_f16_to_f32(v) if wire == WIRE_FP16 else dynar_bf16_to_float(v)


cdef inline uint16_t _narrow(Wire wire, float v) noexcept nogil:
    return dynar_f32_to_f16(v) if wire == WIRE_FP16 else dynar_bf16_from_float(v)


cdef void _accumulate_wire(Wire wire, float* dst, const uint16_t* src, Py_ssize_t n,
                           int carried) noexcept nogil:
    # src is the mean of `carried` ranks' values, dst this rank's own: dst becomes the mean of
    # all carried + 1, which stays within the range of the values themselves.
    cdef Py_ssize_t i
    cdef float weight = <float> carried, count = <float> (carried + 1)
    if wire == WIRE_FP16:
        for i in range(n):
            dst[i] = (dynar_f16_to_f32(src[i]) * weight + dst[i]) / count
    else:
        for i in range(n):
            dst[i] = (dynar_bf16_to_float(src[i]) * weight + dst[i]) / count


# The largest finite value of each wire format: 65504 (fp16), 0x7f7f as bfloat16.
cdef inline float _wire_max(Wire wire) noexcept nogil:
    return 65504.0 if wire == WIRE_FP16 else 3.3895313892515355e38


cdef void _narrow_all(Wire wire, uint16_t* dst, const float* src, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    if wire == WIRE_FP16:
        for i in range(n):
            dst[i] = dynar_f32_to_f16(src[i])
    else:
        for i in range(n):
            dst[i] = dynar_bf16_from_float(src[i])


cdef void _widen_all(Wire wire, float* dst, const uint16_t* src, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    if wire == WIRE_FP16:
        for i in range(n):
            dst[i] = dynar_f16_to_f32(src[i])
    else:
        for i in range(n):
            dst[i] = dynar_bf16_to_float(src[i])


# ---- point-to-point helpers ---------------------------------------------------------------

cdef inline Py_ssize_t _chunk_offset(Py_ssize_t n, int parts, int k) noexcept nogil:
    # Chunk k of n elements cut into `parts` near-equal chunks (the first n % parts get one more).
    return k * (n // parts) + (k if k < n % parts else n % parts)


cdef inline Py_ssize_t _chunk_length(Py_ssize_t n, int parts, int k) noexcept nogil:
    return n // parts + (1 if k < n % parts else 0)


cdef inline int _mod(int a, int p) noexcept nogil:
    return ((a % p) + p) % p


cdef int _wait_all(int count, MPI_Request* requests) noexcept nogil:
    # MPI_Waitall that stops spinning after SPIN_NS (see above).
    cdef int flag = 0, err
    cdef timespec start, now, pause
    pause.tv_sec, pause.tv_nsec = 0, SLEEP_NS
    clock_gettime(CLOCK_MONOTONIC, &start)
    while True:
        err = MPI_Testall(count, requests, &flag, MPI_STATUSES_IGNORE)
        if err != MPI_SUCCESS or flag:
            return err
        clock_gettime(CLOCK_MONOTONIC, &now)
        if (now.tv_sec - start.tv_sec) * 1000000000 + (now.tv_nsec - start.tv_nsec) > SPIN_NS:
            nanosleep(&pause, NULL)


cdef int _window_barrier(MPI_Comm node, MPI_Win window) noexcept nogil:
    # A barrier over the ranks sharing `window` that orders their plain loads and stores to it
    # (MPI-3's unified model: sync, barrier, sync), waiting politely.
    cdef MPI_Request request
    MPI_Win_sync(window)
    cdef int err = MPI_Ibarrier(node, &request)
    if err == MPI_SUCCESS:
        err = _wait_all(1, &request)
    MPI_Win_sync(window)
    return err


cdef int _sendrecv(MPI_Comm comm, MPI_Datatype dtype, size_t item,
                   const char* send, Py_ssize_t nsend, int dest,
                   char* recv, Py_ssize_t nrecv, int source) noexcept nogil:
    # Blocking exchange of any element counts (MPI_PROC_NULL for a one-sided transfer). Both
    # partners loop max(pieces sent, pieces received) times, which is the same on both ends.
    cdef Py_ssize_t done_s = 0, done_r = 0
    cdef int ps, pr, err
    cdef MPI_Request requests[2]
    while done_s < nsend or done_r < nrecv:
        ps = <int> (min(nsend - done_s, <Py_ssize_t> MAX_PART))
        pr = <int> (min(nrecv - done_r, <Py_ssize_t> MAX_PART))
        err = MPI_Irecv(recv + done_r * item, pr, dtype, source if pr > 0 else MPI_PROC_NULL,
                        TAG, comm, &requests[0])
        if err != MPI_SUCCESS:
            return err
        err = MPI_Isend(<void*> (send + done_s * item), ps, dtype,
                        dest if ps > 0 else MPI_PROC_NULL, TAG, comm, &requests[1])
        if err != MPI_SUCCESS:
            _wait_all(1, requests)
            return err
        err = _wait_all(2, requests)
        if err != MPI_SUCCESS:
            return err
        done_s += ps
        done_r += pr
    return MPI_SUCCESS


cdef int _send_and_sum(Ctx* c, const char* send, Py_ssize_t nsend, int dest,
                       char* dst, Py_ssize_t nrecv, int source, double factor,
                       int carried) noexcept nogil:
    # Send `send` to dest while receiving source's values for `dst` segment by segment and
    # summing each one in as soon as it lands: dst = (dst + received) * factor; on a 16-bit
    # wire the received values are the mean of `carried` ranks' and dst becomes the mean
    # with its own (factor unused).
    cdef Py_ssize_t nseg_s = (nsend + SEGMENT - 1) // SEGMENT
    cdef Py_ssize_t nseg_r = (nrecv + SEGMENT - 1) // SEGMENT
    cdef Py_ssize_t i, length
    cdef int err = MPI_SUCCESS, err2
    cdef MPI_Datatype wire_type = c.dtype if c.wire == WIRE_NATIVE else MPI_UINT16_T
    cdef size_t wire_item = c.item if c.wire == WIRE_NATIVE else 2
    cdef const char* wire_send = send
    cdef MPI_Request* requests = <MPI_Request*> malloc((nseg_s + nseg_r + 1) * sizeof(MPI_Request))
    if requests == NULL:
        return OUT_OF_MEMORY
    if c.wire != WIRE_NATIVE:
        _narrow_all(c.wire, c.send16, <const float*> send, nsend)
        wire_send = <const char*> c.send16
    for i in range(nseg_r):
        length = min(nrecv - i * SEGMENT, <Py_ssize_t> SEGMENT)
        err = MPI_Irecv(c.scratch + i * SEGMENT * wire_item, <int> length, wire_type, source,
                        TAG, c.comm, &requests[i])
        if err != MPI_SUCCESS:
            nseg_r = i
            nseg_s = 0
            break
    if err == MPI_SUCCESS:
        for i in range(nseg_s):
            length = min(nsend - i * SEGMENT, <Py_ssize_t> SEGMENT)
            err = MPI_Isend(<void*> (wire_send + i * SEGMENT * wire_item), <int> length,
                            wire_type, dest, TAG, c.comm, &requests[nseg_r + i])
            if err != MPI_SUCCESS:
                nseg_s = i
                break
    for i in range(nseg_r):
        err2 = _wait_all(1, &requests[i])
        if err2 != MPI_SUCCESS:
            err = err2
        if err == MPI_SUCCESS:
            length = min(nrecv - i * SEGMENT, <Py_ssize_t> SEGMENT)
            if c.wire == WIRE_NATIVE:
                _accumulate(c, dst + i * SEGMENT * c.item, c.scratch + i * SEGMENT * c.item,
                            length, factor)
            else:
                _accumulate_wire(c.wire, <float*> dst + i * SEGMENT,
                                 <const uint16_t*> c.scratch + i * SEGMENT, length, carried)
    err2 = _wait_all(<int> nseg_s, requests + nseg_r)
    free(requests)
    return err if err != MPI_SUCCESS else err2


# ---- algorithms ---------------------------------------------------------------------------

cdef int _ring(Ctx* c, char* buf, Py_ssize_t n, double factor) noexcept nogil:
    cdef int p = c.size, r = c.rank, s, sk, rk, err
    cdef int right = _mod(r + 1, p), left = _mod(r - 1, p)
    cdef size_t item = c.item
    # Reduce-scatter: at step s pass chunk r-s on and sum chunk r-s-1 in (it arrives holding
    # s + 1 ranks' values); afterwards rank r holds chunk r+1 complete (and scaled: the last
    # step's sum applies the factor, or on a 16-bit wire, is the mean of all p).
    for s in range(p - 1):
        sk = _mod(r - s, p)
        rk = _mod(r - s - 1, p)
        err = _send_and_sum(c, buf + _chunk_offset(n, p, sk) * item, _chunk_length(n, p, sk),
                            right, buf + _chunk_offset(n, p, rk) * item,
                            _chunk_length(n, p, rk), left, factor if s == p - 2 else 1.0,
                            s + 1)
        if err != MPI_SUCCESS:
            return err
    if c.wire == WIRE_NATIVE:
        # Allgather: pass completed chunks around the ring, straight into place.
        for s in range(p - 1):
            sk = _mod(r + 1 - s, p)
            rk = _mod(r - s, p)
            err = _sendrecv(c.comm, c.dtype, item, buf + _chunk_offset(n, p, sk) * item,
                            _chunk_length(n, p, sk), right,
                            buf + _chunk_offset(n, p, rk) * item, _chunk_length(n, p, rk), left)
            if err != MPI_SUCCESS:
                return err
        return MPI_SUCCESS
    # Wire allgather: completed chunks travel (and are forwarded) in wire format; every rank,
    # the owner included, ends with the widened wire values, so all hold identical bytes.
    sk = _mod(r + 1, p)
    _narrow_all(c.wire, c.all16 + _chunk_offset(n, p, sk),
                <const float*> buf + _chunk_offset(n, p, sk), _chunk_length(n, p, sk))
    for s in range(p - 1):
        sk = _mod(r + 1 - s, p)
        rk = _mod(r - s, p)
        err = _sendrecv(c.comm, MPI_UINT16_T, 2, <char*> (c.all16 + _chunk_offset(n, p, sk)),
                        _chunk_length(n, p, sk), right,
                        <char*> (c.all16 + _chunk_offset(n, p, rk)), _chunk_length(n, p, rk), left)
        if err != MPI_SUCCESS:
            return err
    _widen_all(c.wire, <float*> buf, c.all16, n)
    return MPI_SUCCESS


cdef inline int _pof2_below(int p) noexcept nogil:
    cdef int q = 1
    while q * 2 <= p:
        q *= 2
    return q


cdef inline int _real_rank(int newrank, int extra) noexcept nogil:
    # Inverse of the fold-in numbering: the first `extra` pairs are represented by their odd rank.
    return newrank * 2 + 1 if newrank < extra else newrank + extra


cdef int _fold_in(Ctx* c, char* buf, Py_ssize_t n, int extra, int* newrank) noexcept nogil:
    # With p = 2^k + extra, ranks 0..2*extra-1 pair up: the even one hands its buffer to the
    # odd one and sits out (newrank -1) until _fold_out returns the result.
    cdef int r = c.rank, err
    if r < 2 * extra:
        if r % 2 == 0:
            newrank[0] = -1
            return _sendrecv(c.comm, c.dtype, c.item, buf, n, r + 1, NULL, 0, MPI_PROC_NULL)
        err = _sendrecv(c.comm, c.dtype, c.item, NULL, 0, MPI_PROC_NULL, c.scratch, n, r - 1)
        if err == MPI_SUCCESS:
            _accumulate(c, buf, c.scratch, n, 1.0)
        newrank[0] = r // 2
        return err
    newrank[0] = r - extra
    return MPI_SUCCESS


cdef int _fold_out(Ctx* c, char* buf, Py_ssize_t n, int extra) noexcept nogil:
    cdef int r = c.rank
    if r >= 2 * extra:
        return MPI_SUCCESS
    if r % 2 == 0:
        return _sendrecv(c.comm, c.dtype, c.item, NULL, 0, MPI_PROC_NULL, buf, n, r + 1)
    return _sendrecv(c.comm, c.dtype, c.item, buf, n, r - 1, NULL, 0, MPI_PROC_NULL)


cdef int _recursive_doubling(Ctx* c, char* buf, Py_ssize_t n, double factor) noexcept nogil:
    cdef int pof2 = _pof2_below(c.size), extra = c.size - pof2, newrank = 0, mask, partner
    cdef int err = _fold_in(c, buf, n, extra, &newrank)
    if err != MPI_SUCCESS:
        return err
    if newrank >= 0:
        mask = 1
        while mask < pof2:
            partner = _real_rank(newrank ^ mask, extra)
            err = _sendrecv(c.comm, c.dtype, c.item, buf, n, partner, c.scratch, n, partner)
            if err != MPI_SUCCESS:
                return err
            # Both partners evaluate the same commutative sum, bit for bit.
            _accumulate(c, buf, c.scratch, n, factor if mask * 2 == pof2 else 1.0)
            mask *= 2
    return _fold_out(c, buf, n, extra)


cdef int _rabenseifner(Ctx* c, char* buf, Py_ssize_t n, double factor) noexcept nogil:
    cdef int pof2 = _pof2_below(c.size), extra = c.size - pof2, newrank = 0
    cdef int mask, partner, level = 0, err
    cdef Py_ssize_t lo = 0, hi = n, mid
    cdef Py_ssize_t los[64]
    cdef Py_ssize_t his[64]
    cdef size_t item = c.item
    err = _fold_in(c, buf, n, extra, &newrank)
    if err != MPI_SUCCESS:
        return err
    if newrank >= 0:
        # Recursive halving: partners share a range, each keeps one half summed.
        mask = pof2 // 2
        while mask >= 1:
            partner = _real_rank(newrank ^ mask, extra)
            mid = lo + (hi - lo) // 2
            los[level] = lo
            his[level] = hi
            level += 1
            if newrank & mask:
                err = _sendrecv(c.comm, c.dtype, item, buf + lo * item, mid - lo, partner,
                                c.scratch, hi - mid, partner)
                if err == MPI_SUCCESS:
                    _accumulate(c, buf + mid * item, c.scratch, hi - mid,
                                factor if mask == 1 else 1.0)
                lo = mid
            else:
                err = _sendrecv(c.comm, c.dtype, item, buf + mid * item, hi - mid, partner,
                                c.scratch, mid - lo, partner)
                if err == MPI_SUCCESS:
                    _accumulate(c, buf + lo * item, c.scratch, mid - lo,
                                factor if mask == 1 else 1.0)
                hi = mid
            if err != MPI_SUCCESS:
                return err
            mask //= 2
        # Recursive doubling allgather: retrace the halvings, swapping finished halves.
        mask = 1
        while mask < pof2:
            level -= 1
            partner = _real_rank(newrank ^ mask, extra)
            if lo == los[level]:     # I hold the lower half of the parent range
                err = _sendrecv(c.comm, c.dtype, item, buf + lo * item, hi - lo, partner,
                                buf + hi * item, his[level] - hi, partner)
            else:
                err = _sendrecv(c.comm, c.dtype, item, buf + lo * item, hi - lo, partner,
                                buf + los[level] * item, lo - los[level], partner)
            if err != MPI_SUCCESS:
                return err
            lo = los[level]
            hi = his[level]
            mask *= 2
    return _fold_out(c, buf, n, extra)


cdef int _mpi_allreduce(Ctx* c, char* buf, Py_ssize_t n, double factor) noexcept nogil:
    cdef Py_ssize_t done = 0
    cdef int part, err = MPI_SUCCESS
    while done < n:
        part = <int> min(n - done, <Py_ssize_t> PIECE)
        err = MPI_Allreduce(MPI_IN_PLACE, buf + done * c.item, part, c.dtype, MPI_SUM, c.comm)
        if err != MPI_SUCCESS:
            return err
        _scale(buf + done * c.item, part, c.kind, factor)
        done += part
    return MPI_SUCCESS


cdef void _scale(void* buf, Py_ssize_t n, FloatKind kind, double factor) noexcept nogil:
    # Serial on purpose: it runs on a piece MPI has just reduced (still in cache), on the
    # synchronizer's communication thread, where an OpenMP team of its own would compete
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


cdef class Collective:
    """Allreduce-mean over one communicator with a choice of algorithm.

    Collective(comm, local, reduce_threads=1): collective over `comm`; `local` holds the
    ranks of `comm` that form this rank's node (they must share memory), in `comm`'s order.
    Both are duplicated, so these messages never match the caller's. Then
    allreduce_mean(buf, algorithm, wire) reduces `buf` (1-D float32/float64, C-contiguous)
    in place to the mean over ranks; algorithm and wire are the ids of the enums above.
    Every rank must make the same sequence of calls with the same sizes and algorithms."""
    cdef object _comm, _local, _leaders
    cdef MPI_Comm comm, local, leaders
    cdef readonly int rank, size, local_rank, local_size, nodes
    cdef public int reduce_threads
    cdef char* scratch
    cdef size_t scratch_bytes
    cdef uint16_t* wire_space
    cdef size_t wire_bytes
    cdef MPI_Win window
    cdef char* shared

    def __cinit__(self):
        self.window = MPI_WIN_NULL

    def __init__(self, Comm comm not None, Comm local not None, reduce_threads=1):
        from mpi4py import MPI
        self._comm = comm.Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._local = local.Dup()
        self.local_rank, self.local_size = self._local.Get_rank(), self._local.Get_size()
        self._leaders = self._comm.Split(0 if self.local_rank == 0 else MPI.UNDEFINED, self.rank)
        self.nodes = self._comm.allreduce(1 if self.local_rank == 0 else 0)
        self.comm = (<Comm> self._comm).ob_mpi
        self.local = (<Comm> self._local).ob_mpi
        self.leaders = (<Comm> self._leaders).ob_mpi
        self.reduce_threads = max(1, int(reduce_threads))

    def __dealloc__(self):
        cdef int finalized = 0
        free(self.scratch)
        free(self.wire_space)
        MPI_Finalized(&finalized)
        if self.window != MPI_WIN_NULL and not finalized:
            MPI_Win_unlock_all(self.window)
            MPI_Win_free(&self.window)

    @property
    def comm_handle(self):
        """The private duplicate communicator (mpi4py), for the caller's own small
        collectives between allreduces (tuning, agreeing on timings)."""
        return self._comm

    def free(self):
        """Release the communicators and the shared window (collective over the communicator)."""
        if self.window != MPI_WIN_NULL:
            MPI_Win_unlock_all(self.window)
            MPI_Win_free(&self.window)
            self.window = MPI_WIN_NULL
        for c in (self._leaders, self._local, self._comm):
            if c is not None and c:
                c.Free()

    cdef int _reserve(self, size_t scratch_bytes, size_t wire_bytes) except -1:
        cdef void* p
        if scratch_bytes > self.scratch_bytes:
            p = realloc(self.scratch, scratch_bytes)
            if p == NULL:
                raise MemoryError(f"allreduce: cannot allocate {scratch_bytes} bytes of workspace")
            self.scratch, self.scratch_bytes = <char*> p, scratch_bytes
        if wire_bytes > self.wire_bytes:
            p = realloc(self.wire_space, wire_bytes)
            if p == NULL:
                raise MemoryError(f"allreduce: cannot allocate {wire_bytes} bytes of workspace")
            self.wire_space, self.wire_bytes = <uint16_t*> p, wire_bytes
        return 0

    cdef int _open_window(self) except -1:
        # Collective over the node, on the first hierarchical call: rank 0 of the node
        # allocates one slot per local rank plus one result slot; all map it.
        cdef MPI_Aint size = 0
        cdef int disp = 0, err
        cdef void* base = NULL
        if self.local_rank == 0:
            size = <MPI_Aint> (self.local_size + 1) * SHARED_SLOT_BYTES
        err = MPI_Win_allocate_shared(size, 1, MPI_INFO_NULL, self.local, &base, &self.window)
        if err == MPI_SUCCESS:
            err = MPI_Win_shared_query(self.window, 0, &size, &disp, &self.shared)
        if err == MPI_SUCCESS:
            err = MPI_Win_lock_all(MPI_MODE_NOCHECK, self.window)
        if err != MPI_SUCCESS:
            raise RuntimeError(f"hierarchical allreduce: cannot create the node's shared "
                               f"window: {mpi_error_text(err)}")
        return 0

    cdef int _node_barrier(self) noexcept nogil:
        return _window_barrier(self.local, self.window)

    cdef int _hierarchical(self, Ctx* c, Ctx* leaders, char* buf, Py_ssize_t n,
                           double factor) noexcept nogil:
        cdef Py_ssize_t piece = SHARED_SLOT_BYTES // c.item, start, m, off, length
        cdef int q, err = MPI_SUCCESS, L = self.local_size
        cdef size_t item = c.item
        cdef char* result = self.shared + <size_t> L * SHARED_SLOT_BYTES
        cdef char* mine = self.shared + <size_t> self.local_rank * SHARED_SLOT_BYTES
        cdef double node_factor = factor if self.nodes == 1 else 1.0
        # The other slots, in slot order, as the node-stage sum reads them.
        cdef const char** others = <const char**> malloc(max(L - 1, 1) * sizeof(char*))
        if others == NULL:
            return OUT_OF_MEMORY
        start = 0
        while start < n and err == MPI_SUCCESS:
            m = min(piece, n - start)
            memcpy(mine, buf + start * item, m * item)
            err = self._node_barrier()
            if err != MPI_SUCCESS:
                break
            # Each local rank sums its own slice of the piece over all slots, in slot order.
            off = _chunk_offset(m, L, self.local_rank)
            length = _chunk_length(m, L, self.local_rank)
            memcpy(result + off * item, self.shared + off * item, length * item)
            for q in range(1, L):
                others[q - 1] = self.shared + <size_t> q * SHARED_SLOT_BYTES + off * item
            if L > 1 and c.kind == F32:
                _sum_sources(<float*> (result + off * item), <const float**> others, L - 1,
                             length, <float> node_factor, c.threads)
            elif L > 1:
                _sum_sources(<double*> (result + off * item), <const double**> others, L - 1,
                             length, node_factor, c.threads)
            err = self._node_barrier()
            if err == MPI_SUCCESS and self.local_rank == 0 and self.nodes > 1:
                err = _ring(leaders, result, m, factor)
            if err == MPI_SUCCESS:
                err = self._node_barrier()
            if err == MPI_SUCCESS:
                memcpy(buf + start * item, result, m * item)
            start += m
        free(others)
        return err

    def allreduce_mean(self, buf, int algorithm, int wire=WIRE_NATIVE, threads=None):
        """Reduce `buf` in place to the mean over the communicator's ranks, summing large
        chunks with `threads` OpenMP threads (default: reduce_threads). A caller that runs
        beside busy compute threads passes 1: a second team would compete for their cores."""
        cdef FloatKind kind = float_kind("buf", buf)
        cdef cnp.ndarray a = check_float("buf", buf, 1, kind, output=True)
        cdef Py_ssize_t n = a.shape[0]
        cdef Algorithm alg = _algorithm(algorithm)
        cdef Wire w = _wire(wire)
        if w != WIRE_NATIVE and (alg != ALG_RING or kind != F32):
            raise ValueError(f"a 16-bit wire needs the ring algorithm and a float32 buffer, "
                             f"got algorithm id {algorithm} on {a.dtype}")
        cdef Ctx c, lead
        c.comm, c.rank, c.size = self.comm, self.rank, self.size
        c.kind = kind
        c.dtype = MPI_FLOAT if kind == F32 else MPI_DOUBLE
        c.item = 4 if kind == F32 else 8
        c.wire = w
        c.threads = self.reduce_threads if threads is None else max(1, int(threads))
        if n == 0 or self.size == 1:
            return
        cdef Py_ssize_t chunk = (n + self.size - 1) // self.size
        if alg == ALG_RING:
            self._reserve(chunk * (c.item if w == WIRE_NATIVE else 2),
                          (n + chunk) * 2 if w != WIRE_NATIVE else 0)
        elif alg == ALG_RECURSIVE_DOUBLING or alg == ALG_RABENSEIFNER:
            self._reserve(n * c.item, 0)
        elif self.nodes == self.size:  # hierarchical, one rank per node: a ring over nodes
            self._reserve(chunk * c.item, 0)
        else:                         # hierarchical: the leaders' ring runs on window pieces
            self._reserve((SHARED_SLOT_BYTES // c.item // self.nodes + 1) * c.item, 0)
            if self.window == MPI_WIN_NULL:
                self._open_window()
        c.scratch = self.scratch
        c.all16 = self.wire_space
        c.send16 = self.wire_space + n if self.wire_space != NULL else NULL
        lead = c
        lead.comm = self.leaders
        lead.rank = self._leaders.Get_rank() if self.local_rank == 0 else 0
        lead.size = self.nodes
        cdef char* p = <char*> data(a)
        cdef double factor = 1.0 / self.size
        cdef int err
        with nogil:
            if alg == ALG_MPI:
                err = _mpi_allreduce(&c, p, n, factor)
            elif alg == ALG_RING:
                err = _ring(&c, p, n, factor)
            elif alg == ALG_RECURSIVE_DOUBLING:
                err = _recursive_doubling(&c, p, n, factor)
            elif alg == ALG_RABENSEIFNER:
                err = _rabenseifner(&c, p, n, factor)
            elif self.nodes == self.size:  # one rank per node: the leaders' ring is everything
                err = _ring(&lead, p, n, factor)
            # else also on a node of one rank among larger nodes: every leader must cut the
            # buffer into the same window pieces, or their rings' messages would not match
            else:
                err = self._hierarchical(&c, &lead, p, n, factor)
        if err == OUT_OF_MEMORY:
            raise MemoryError(f"allreduce (algorithm id {algorithm}): out of memory for MPI "
                              f"requests")
        if err != MPI_SUCCESS:
            raise RuntimeError(f"allreduce (algorithm id {algorithm}) of {n} elements failed: "
                               f"{mpi_error_text(err)}")


def mpi_error_text(int err):
    """The MPI library's words for error code `err`, with the code."""
    cdef char text[MPI_MAX_ERROR_STRING + 1]
    cdef int length = 0
    if MPI_Error_string(err, text, &length) != MPI_SUCCESS:
        return f"MPI error code {err}"
    return f"{text[:length].decode(errors='replace')} (MPI error code {err})"


cdef Algorithm _algorithm(int algorithm) except *:
    if not 0 <= algorithm < ALGORITHM_COUNT:
        raise ValueError(f"algorithm: no allreduce algorithm has id {algorithm}")
    return <Algorithm> algorithm


cdef Wire _wire(int wire) except *:
    if not 0 <= wire < WIRE_COUNT:
        raise ValueError(f"wire: no wire format has id {wire}")
    return <Wire> wire


def compress_with_feedback(grad, residual, int wire):
    """Error-feedback rounding of one rank's gradient to the wire format, in place:
    g <- round(g + residual), residual <- (g + residual) - round(g + residual). The rounded
    values are exact in the wire format, so the first hop of a wire ring loses nothing, and
    what rounding dropped this step is added back the next. round() saturates at the
    format's largest finite value; a non-finite g + residual is passed on unrounded and
    leaves its residual as it was."""
    cdef cnp.ndarray g = check_float("grad", grad, 1, F32, output=True)
    cdef cnp.ndarray r = check_float("residual", residual, 1, F32, output=True)
    if g.shape[0] != r.shape[0]:
        raise ValueError(f"residual: expected {g.shape[0]} elements like grad, got {r.shape[0]}")
    cdef Wire w = _wire(wire)
    if w == WIRE_NATIVE:
        raise ValueError("wire: compression needs a 16-bit wire format")
    cdef float* gp = <float*> data(g)
    cdef float* rp = <float*> data(r)
    cdef Py_ssize_t i, n = g.shape[0]
    cdef float want, sent, largest = _wire_max(w)
    with nogil:
        for i in range(n):
            want = gp[i] + rp[i]
            if not isfinite(want):
                # Sent as it is, for the step's non-finite check to see; the residual keeps
                # what it had, so a skipped step leaves the next ones unharmed.
                gp[i] = want
                continue
            # Beyond the format's range: the largest finite value, the excess carried over.
            sent = _widen(w, _narrow(w, min(max(want, -largest), largest)))
            rp[i] = want - sent
            gp[i] = sent


cdef class Pending:
    """An MPI_Iallreduce in flight. The buffer must stay untouched until test() returns True
    or wait() returns; then it holds the mean over the communicator's ranks."""
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

    cdef int _failed(self, str call, int err) except -1:
        # The requests are in an undefined state: never wait for them again (the job is
        # ending; the buffer stays referenced by this object).
        self.done = True
        raise RuntimeError(f"MPI_Iallreduce of {self.n} elements: {call} failed: "
                           f"{mpi_error_text(err)}")

    def test(self):
        """Progress the reduction without blocking; True once complete (and scaled).
        RuntimeError naming the MPI error if the library reports one."""
        cdef int flag = 1, err
        if self.done:
            return True
        with nogil:
            err = MPI_Testall(self.count, self.requests, &flag, MPI_STATUSES_IGNORE)
            if err == MPI_SUCCESS and flag:
                self._finish()
        if err != MPI_SUCCESS:
            self._failed("MPI_Testall", err)
        return bool(flag)

    def wait(self):
        """Block until the reduction is complete (and scaled); RuntimeError as test()."""
        cdef int err
        if self.done:
            return
        with nogil:
            err = MPI_Waitall(self.count, self.requests, MPI_STATUSES_IGNORE)
            if err == MPI_SUCCESS:
                self._finish()
        if err != MPI_SUCCESS:
            self._failed("MPI_Waitall", err)


def start_mean(buf, Comm comm not None):
    """Post an in-place MPI_Iallreduce of `buf` (1-D float32/float64, C-contiguous) over
    `comm` and return its Pending; on completion buf holds the mean over ranks."""
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
        raise RuntimeError(f"MPI_Iallreduce of {n} elements failed: {mpi_error_text(err)}")
    return p


# ---- node-shared memory ---------------------------------------------------------------------

def window_barrier(Comm node not None, Win window not None):
    """Barrier over `node` (the ranks sharing `window`, locked with MPI_Win_lock_all) after
    which every store one rank made to the window before it is visible to the others. Waits
    without keeping a core busy, like the algorithms, and releases the GIL."""
    cdef MPI_Comm c = node.ob_mpi
    cdef MPI_Win w = window.ob_mpi
    cdef int err
    with nogil:
        err = _window_barrier(c, w)
    if err != MPI_SUCCESS:
        raise RuntimeError(f"node barrier failed: {mpi_error_text(err)}")


def mean_into(out, others, factor, threads=1):
    """out = (out + others[0] + others[1] + ...) * factor, elementwise, in place, summed in
    that order (float32, 1-D, all of one length). One pass over memory: the sum runs in blocks
    that stay in cache while each source streams through. Large buffers are summed by
    `threads` OpenMP threads; the GIL is released."""
    cdef cnp.ndarray o = check_float("out", out, 1, F32, output=True)
    cdef Py_ssize_t n = o.shape[0]
    cdef list arrays = []
    for k, a in enumerate(others):
        a = check_float(f"others[{k}]", a, 1, F32)
        if (<cnp.ndarray> a).shape[0] != n:
            raise ValueError(f"others[{k}]: expected {n} elements like out, "
                             f"got {(<cnp.ndarray> a).shape[0]}")
        arrays.append(a)
    cdef float f = <float> check_real("factor", factor)
    cdef int count = len(arrays)
    cdef const float** src = <const float**> malloc(max(count, 1) * sizeof(float*))
    if src == NULL:
        raise MemoryError("mean_into: cannot allocate the source list")
    for k in range(count):
        src[k] = <const float*> data(arrays[k])
    cdef float* dst = <float*> data(o)
    cdef int team = max(1, int(threads))
    with nogil:
        _sum_sources(dst, src, count, n, f, team)
    free(src)
