"""Under mpiexec: a custom loop with DataParallel, micro-batches under no_sync() and the
gradient clipped by its global norm. Every rank must get the same norm and stay bitwise
identical; rank 0 then trains the same steps alone (each micro-batch the union of the
ranks' shares, BatchNorm over it) and both must agree up to summation order.

argv: steps global_batch micro_batches max_norm"""
import hashlib
import sys

import numpy as np

from dynar import nn, optim
from dynar.dist import DataParallel, Job

steps, batch, micro, max_norm = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    float(sys.argv[4])
job = Job.start()
rng = np.random.default_rng(0)
data = [(rng.standard_normal((batch, 2, 6, 6)).astype(np.float32), rng.integers(0, 4, batch))
        for _ in range(steps)]


def net():
    g = np.random.default_rng(1)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, generator=g), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 4, generator=g)
                         ).flatten_parameters()


def micro_batches(x, y, rank, world):
    """This rank's share of each micro-batch: micro-batch k is the k-th slice of every
    rank's share, so that the ranks' k-th slices together are one slice of the batch."""
    share = len(y) // world // micro
    for k in range(micro):
        lo = k * share * world + rank * share
        yield x[lo:lo + share], y[lo:lo + share]


def train(model, opt, dp, rank, world):
    crit, norms = nn.CrossEntropyLoss(), []
    for x, y in data:
        model.zero_grad()
        for k, (xs, ys) in enumerate(micro_batches(x, y, rank, world)):
            if dp is not None and k < micro - 1:
                with dp.no_sync():
                    crit.forward(model.forward(xs), ys)
                    model.backward(crit.backward(1.0 / micro))
            else:
                crit.forward(model.forward(xs), ys)
                model.backward(crit.backward(1.0 / micro))
        if dp is not None:
            norms.append(dp.clip_grad_norm_(max_norm))
            dp.step()
        else:
            norms.append(optim.clip_grad_norm_(model, max_norm))
            opt.step()
    return norms


model = net()
opt = optim.SGD(model, lr=0.1, momentum=0.9)
with DataParallel(model, opt, job) as dp:
    shared = dp.describe()["node replica"]
    norms = train(model, opt, dp, job.rank, job.world)
everyone = job.comm.allgather((norms, hashlib.sha256(model.flat_params.tobytes()).hexdigest()))
assert all(e == everyone[0] for e in everyone), f"ranks differ: {everyone}"
if job.rank == 0:
    alone = net()
    reference = train(alone, optim.SGD(alone, lr=0.1, momentum=0.9), None, 0, 1)
    assert min(reference) > max_norm, f"clipping never acted: {reference}"
    np.testing.assert_allclose(norms, reference, rtol=1e-5)
    np.testing.assert_allclose(model.flat_params, alone.flat_params, rtol=1e-5, atol=1e-6)
print(f"rank {job.rank} ok, node replica {shared}", flush=True)
