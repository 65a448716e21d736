"""Under mpiexec: README's custom loop across ranks. Every rank trains LeNet with
DataParallel on its share of each global batch; rank 0 also trains the same model alone on
the whole batches, and the two must agree (up to summation order), with every replica
bitwise identical. Then a step that raises inside `with DataParallel(...)` must leave the
model usable on its own (private buffers, no hooks).

argv: steps global_batch"""
import hashlib
import sys

import numpy as np

from dynar import models, nn, optim
from dynar.dist import DataParallel, Job

steps, batch = int(sys.argv[1]), int(sys.argv[2])
job = Job.start()
rng = np.random.default_rng(0)
data = [(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
         rng.integers(0, 10, batch)) for _ in range(steps)]
share = slice(job.rank * batch // job.world, (job.rank + 1) * batch // job.world)


def train(model, opt, dp, share):
    crit = nn.CrossEntropyLoss()
    for x, y in data:
        model.zero_grad()
        crit.forward(model.forward(x[share]), y[share])
        model.backward(crit.backward())
        dp.step() if dp is not None else opt.step()


model = models.get("lenet", seed=job.rank)      # DataParallel starts every rank from rank 0's
opt = optim.SGD(model, lr=0.05, momentum=0.9)
with DataParallel(model, opt, job) as dp:
    shared = dp.describe()["node replica"]
    train(model, opt, dp, share)
params = model.flat_params.copy()
digests = job.comm.allgather(hashlib.sha256(params.tobytes()).hexdigest())
assert len(set(digests)) == 1, f"replicas differ: {digests}"
if job.rank == 0:
    alone = models.get("lenet", seed=0)
    train(alone, optim.SGD(alone, lr=0.05, momentum=0.9), None, slice(None))
    np.testing.assert_allclose(params, alone.flat_params, rtol=1e-4, atol=2e-5)

# An error inside the block: this rank tears down alone, and the model trains on its own.
model = models.get("lenet", seed=0)
opt = optim.SGD(model, lr=0.05, momentum=0.9)
try:
    with DataParallel(model, opt, job) as dp:
        raise KeyError("inside the step")
except KeyError:
    pass
assert dp.sync is None and not model._grad_ready_hooks, "still listening to backward"
before = model.flat_params.copy()
model.flat_params[:] = job.rank                 # private: no other rank sees this
job.comm.Barrier()
assert (model.flat_params == job.rank).all(), "parameters still shared after the error"
model.flat_params[:] = before
train(model, opt, None, slice(None))
print(f"rank {job.rank} ok, node replica {shared}", flush=True)
