"""StepArena: one block of memory for the arrays a model's layers hand each other in a pass.

A training step keeps every layer's output (and a max pool's argmax, a dropout's mask) from
its forward until its backward, and passes a gradient from each layer to the one before.
Each of those arrays is dead long before the step ends: a layer's output once its own
backward is done (every other reader of it ran backward earlier), or already once the next
layer's forward has read it where a bf16 copy of it serves backward, a gradient once the
layer before has consumed it. Kept by each layer across steps they would add up to every
output plus every gradient; laid out by when each is alive, they need about the most that
is alive at once, which is what PyTorch's caching allocator holds too.

Protocol (docs/DESIGN.md, "Buffers: who owns what"):
- the model's forward starts a pass with `begin(key)` (key: the input's shape and the mode);
- a layer takes what its forward keeps and what its backward returns with `take`;
- a container calls `done_with(layer)` after the layer's backward, which gives back what the
  layer's forward took, and gives back each gradient with `passed_on` once the next layer has
  consumed it; a module that hands one gradient to two branches (a residual block's
  shortcut and main branch) first `share`s it;
- in bf16, a ReLU notes the bf16 copy it keeps of its output (`note_bf16_copy`), the next
  layer keeps that copy instead of the output (`bf16_copy`), and the container gives the
  float32 output back with `passed_on` right after the next layer's forward;
- what is never given back stays alive until the next pass begins (the model's output,
  which its caller may read after backward, is `share`d so that it is not).

The first pass of a kind (key) allocates every array afresh and records when each is taken
and given back; the next `begin` of that kind plans an arena from those lifetimes (largest
first, each at the lowest offset clear of the arrays alive beside it), and later passes take
their arrays from it in the same order: no allocation in the steady state. A take is served
from the plan only when every earlier array planned into the same memory has been given
back, else afresh (and the pass is planned again), so a pass that strays from the recorded
one costs memory, never correctness. All kinds share one arena: passes never overlap.
"""
import math
import mmap

import numpy as np

_ALIGN = 64     # bytes: every planned array starts on a cache line
# Arrays from this size up get a memory mapping of their own (mapped_empty; kernel
# workspace likewise, pyx/_scratch.pxd).
_OWN_MAPPING_BYTES = 1 << 20
# Frees the pages of a shared mapping at once (Linux); elsewhere they go when it is dropped.
_FREE_PAGES = getattr(mmap, "MADV_REMOVE", None)
# Passes that take less in all than this are not worth an arena: LeNet at batch 64 (5 MB)
# ran 3-5% slower a step on its bookkeeping, a few microseconds a layer, for a few MB saved
# (docs/notes/2026-12-02-memory.md).
SMALL_PASS_BYTES = 64 << 20


class _Plan:
    def __init__(self):
        self.takes = []     # per take: (bytes, offset, earlier takes sharing its memory)


class StepArena:
    """min_bytes: passes that take less in all are `small` (default SMALL_PASS_BYTES).
    poison: fill every array given back with NaN (integers: all ones), so that a layer
    reading one after it was given back computes garbage a test sees (a debugging aid)."""

    def __init__(self, min_bytes=SMALL_PASS_BYTES, poison=False):
        self.min_bytes, self.poison = min_bytes, poison
        self._arena = np.empty(0, np.uint8)
        self._plans = {}        # key -> _Plan
        self._plan = _Plan()
        self._key = None
        # This pass's takes: bytes, clock at take and at give-back (None: alive).
        self._sizes, self._starts, self._ends = [], [], []
        self._count = self._clock = 0
        # id(array) -> [take index, array, owners, its own memory mapping or None]
        self._held = {}
        self._owned = {}        # id(layer) -> the arrays its forward kept
        self._strayed = False
        self._bytes = {}        # key -> what its last pass took in all
        # id(array) -> (array, its bf16 copy) until the array is given back; the entry holds
        # the array, so its id cannot go to another meanwhile.
        self._bf16_copies = {}

    @property
    def followed_plan(self):
        """Whether every array of the pass under way (or the last one) came from the plan."""
        return not self._strayed

    def small(self, key):
        """Whether passes of kind `key` took so little (min_bytes) that the layers had
        better keep buffers of their own. Unknown until one has run."""
        return self._bytes.get(key, self.min_bytes) < self.min_bytes

    def finish(self):
        """The pass under way is over: every array it took is free. Plans its kind anew
        where it strayed from the plan."""
        if self._key is None:
            return
        self._bytes[self._key] = sum(self._sizes[:self._count])
        if self._strayed or self._count != len(self._plan.takes):
            self._plans[self._key] = self._replan()
        self._key = None

    def begin(self, key):
        """A pass of kind `key` starts (the last one finished)."""
        self.finish()
        self._held.clear()
        self._owned.clear()
        self._bf16_copies.clear()
        self._count = self._clock = 0
        self._strayed = False
        self._key = key
        self._plan = self._plans.get(key) or _Plan()

    def take(self, shape, dtype=np.float32, owner=None):
        """An array of `shape` that nothing else uses until it is given back; with `owner`
        (a layer), given back by done_with(owner)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        i = self._count
        self._count = i + 1
        self._clock += 1
        if i == len(self._sizes):
            self._sizes.append(0)
            self._starts.append(0)
            self._ends.append(None)
        self._sizes[i], self._starts[i], self._ends[i] = nbytes, self._clock, None
        planned = self._plan.takes[i] if i < len(self._plan.takes) else None
        mapping = None
        if planned is not None and planned[0] == nbytes and self._given_back(planned[2]):
            array = np.ndarray(shape, dtype, self._arena, planned[1])
        else:
            self._strayed = True
            array = mapped_empty(shape, dtype)
            mapping = _own_mapping(array)
        self._held[id(array)] = [i, array, 1, mapping]
        if owner is not None:
            self._owned.setdefault(id(owner), []).append(array)
        return array

    def _given_back(self, takes):
        """Whether every one of these earlier takes of this pass has been given back."""
        ends = self._ends
        for k in takes:
            if ends[k] is None:
                return False
        return True

    def note_bf16_copy(self, array, copy):
        """`copy` (uint16) holds `array` rounded to bf16 for the rest of this pass."""
        self._bf16_copies[id(array)] = (array, copy)

    def bf16_copy(self, array):
        """The bf16 copy noted of `array` this pass, or None."""
        entry = self._bf16_copies.get(id(array))
        return None if entry is None else entry[1]

    def share(self, array):
        """`array` has one more reader (a second branch's backward; the model's caller): it
        is free once each has passed it on."""
        entry = self._held.get(id(array))
        if entry is not None:
            entry[2] += 1

    def passed_on(self, done, result=None):
        """A layer consumed `done` (in backward; or in forward, an output kept as a bf16
        copy) and returned `result`: `done` is given back (once every owner has) unless
        `result` lives in it (an in-place layer, a reshape). Arrays that did not come from
        `take` are left alone."""
        if done is None or result is done or (
                result is not None and np.may_share_memory(result, done)):
            return
        entry = self._held.get(id(done))
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            if self.poison:
                entry[1].view(np.uint8).fill(0xFF)      # NaN in every float
            elif entry[3] is not None and _FREE_PAGES is not None:
                # Its memory goes back now, though a layer may still refer to it (an output
                # given back in forward, which the layer that took it holds until its
                # backward). The mapping is shared: only MADV_REMOVE frees its pages.
                entry[3].madvise(_FREE_PAGES)
            del self._held[id(done)]
            self._bf16_copies.pop(id(done), None)
            self._clock += 1
            self._ends[entry[0]] = self._clock

    def done_with(self, layer):
        """`layer`'s backward has run: what its forward kept is dead."""
        for array in self._owned.pop(id(layer), ()):
            self.passed_on(array)

    def _replan(self):
        n = self._count
        end_of_pass = self._clock + 1
        blocks = [(self._sizes[i], self._starts[i],
                   end_of_pass if self._ends[i] is None else self._ends[i], i)
                  for i in range(n)]
        offsets = [0] * n
        placed = []     # (offset, aligned bytes, start, end)
        for size, start, end, i in sorted(blocks, key=lambda b: (-b[0], b[3])):
            need = -(-size // _ALIGN) * _ALIGN
            offset = 0
            for o, s in sorted((o, s) for o, s, a, b in placed if a < end and start < b):
                if offset + need <= o:
                    break
                offset = max(offset, o + s)
            offsets[i] = offset
            placed.append((offset, need, start, end))
        plan = _Plan()
        for i in range(n):
            lo, hi = offsets[i], offsets[i] + self._sizes[i]
            sharing = tuple(k for k in range(i)
                            if offsets[k] < hi and lo < offsets[k] + self._sizes[k])
            plan.takes.append((self._sizes[i], offsets[i], sharing))
        total = max((o + s for o, s, _, _ in placed), default=0)
        if total > self._arena.size:
            self._arena = mapped_empty((total,), np.uint8)
        return plan

    @property
    def nbytes(self):
        """Bytes of the planned arena."""
        return self._arena.nbytes


def _own_mapping(array):
    """The memory mapping `array`, from mapped_empty, has to itself, or None."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap):
        return base.obj
    return None


def mapped_empty(shape, dtype=np.float32):
    """A new array; a large one in its own memory mapping, whose pages go back to the system
    as soon as it is dropped. malloc keeps freed blocks below its mmap threshold for reuse,
    and each large block it frees raises that threshold (up to 32 MB): the arrays of a
    recorded pass, or of kernel tuning, would stay resident beside what the steps use."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < _OWN_MAPPING_BYTES:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)
