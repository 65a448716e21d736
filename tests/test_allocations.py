"""A steady-state training step allocates no memory: the arrays layers hand each other come
from the model's arena (planned after the first step), kernel workspace is reused, and the
convolution algorithms share one workspace. Measured with tracemalloc, which sees numpy's
arrays (in numpy's own domain), dynar's kernel workspace (in dynar's) and Python's objects."""
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from dynar import kernels, models, nn, optim

# Python objects a step creates and drops (array views, tuples): tens of bytes each, a few
# hundred a layer (each forward takes its output anew from the arena, as a view). An array
# or workspace of a layer would be kilobytes at least (the smallest conv output below, 4
# images of ResNet-18's 512 x 4 x 4, is 128 KB).
SMALL = 8 << 10
PER_LAYER = 512
WORKSPACE_DOMAIN = 0x64796E
DATA_DOMAINS = (np.lib.tracemalloc_domain, WORKSPACE_DOMAIN)


def _data_bytes(snapshot):
    """Bytes of array data and kernel workspace alive in `snapshot`."""
    return sum(t.size for t in snapshot.traces if t.domain in DATA_DOMAINS)


def one_step(model, crit, opt, x, y):
    model.zero_grad()
    crit.forward(model.forward(x), y)
    model.backward(crit.backward())
    opt.step()


@pytest.mark.parametrize("arena", ["own buffers", "arena"])
@pytest.mark.parametrize("name, variant", [("lenet", None), ("alexnet", "cifar"),
                                           ("vgg11_bn", "cifar"), ("resnet18", "cifar")])
def test_a_steady_state_step_allocates_nothing(name, variant, arena):
    # 4 images are a small pass: the layers keep their own buffers unless the arena is told
    # to take any pass.
    model = models.get(name, num_classes=10, **({"variant": variant} if variant else {}))
    if arena == "arena":
        model.step_arena = nn.StepArena(min_bytes=0)
    crit, opt = nn.CrossEntropyLoss(), optim.SGD(model, lr=0.01, momentum=0.9)
    x = np.random.default_rng(0).standard_normal((4,) + tuple(model.input_shape),
                                                 dtype=np.float32)
    y = np.arange(4, dtype=np.int64) % 10
    for _ in range(2):
        one_step(model, crit, opt, x, y)
    budget = SMALL + PER_LAYER * len(list(model.modules()))
    tracemalloc.start()
    try:
        for _ in range(2):
            data = _data_bytes(tracemalloc.take_snapshot())
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            one_step(model, crit, opt, x, y)
            current, peak = tracemalloc.get_traced_memory()
            assert peak - start < budget, f"{name}: a step allocated {peak - start} bytes"
            assert current - start < SMALL, f"{name}: a step kept {current - start} bytes"
            kept = _data_bytes(tracemalloc.take_snapshot()) - data
            assert kept == 0, f"{name}: a step kept {kept} bytes of arrays or workspace"
    finally:
        tracemalloc.stop()


def test_kernel_workspace_is_visible_to_tracemalloc(rng):
    # The check above would pass vacuously if workspace escaped tracemalloc: growing a
    # kernel's workspace (here the loss's per-row buffer, to a size no other test reaches)
    # must register in dynar's domain.
    rows = 1 << 20
    logits = rng.standard_normal((rows, 2)).astype(np.float32)
    labels = np.zeros(rows, np.int64)
    probs = np.empty_like(logits)
    tracemalloc.start()
    try:
        kernels.loss.softmax_cross_entropy_forward(probs, logits, labels)
        traces = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, WORKSPACE_DOMAIN)]).traces
        assert sum(t.size for t in traces) >= rows * 8, traces
    finally:
        tracemalloc.stop()


def test_the_convolution_algorithms_share_one_workspace():
    # In a fresh process, where no earlier call has grown the workspace: after each of the
    # four algorithms ran forward and backward, one workspace buffer is alive, not four.
    code = f"""
import tracemalloc
import numpy as np
tracemalloc.start()
from dynar.kernels import direct, im2col, tapgemm, winograd
x = np.ones((4, 8, 12, 12), np.float32)
w = np.ones((8, 8, 3, 3), np.float32)
y, dx, dw = np.empty_like(x), np.empty_like(x), np.zeros_like(w)
for kernel in (im2col, winograd, direct, tapgemm):
    kernel.forward(y, x, w, None, 1, 1)
    kernel.backward(dx, dw, None, y, x, w, 1, 1)
domain = tracemalloc.DomainFilter(True, {WORKSPACE_DOMAIN})
print(len(tracemalloc.take_snapshot().filter_traces([domain]).traces))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("what", ["kernel tuning", "a released workspace"])
def test_large_temporary_buffers_keep_malloc_s_threshold_under_a_megabyte(what):
    # Each large block malloc frees raises its mmap threshold; later blocks below it come
    # from the heap, which keeps what a training step frees (ResNet-18's steps held 75 MB
    # more after tuning in the same process). Blocks under 1 MB still come from malloc, so
    # the threshold may reach that. In a fresh process, after `what` freed larger buffers,
    # a 1 MB array is still a mapping of its own, not in the heap.
    code = f"""
import numpy as np
from dynar.kernels import conv, winograd
from dynar.nn import Conv2d, kernel_tuning
from dynar.nn.arena import mapped_empty
probe = 1 << 20
if {what!r} == "kernel tuning":
    kernel_tuning.time_algorithms((32, 64, 32, 32), Conv2d(64, 64, 3, padding=1), repeats=1)
else:   # (the arrays in mappings too, so that freeing them raises nothing)
    x, y = mapped_empty((32, 64, 32, 32)), mapped_empty((32, 64, 32, 32))
    x.fill(1)
    winograd.forward(y, x, np.ones((64, 64, 3, 3), np.float32), None, 1, 1)
    assert conv.workspace_bytes() > 2 * probe
    conv.release_workspace()
    del x, y
address = np.empty(probe, np.uint8).__array_interface__["data"][0]
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    if rest[-1] == "[heap]":
        low, high = (int(v, 16) for v in span.split("-"))
        print("heap" if low <= address < high else "mapping")
        break
else:
    print("mapping")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mapping"
