"""What the end-of-step decision costs a training step: the check of this rank's share of the
averaged gradient for inf/NaN and the one small allreduce that gives every rank the verdict
and any stop request (dist/data_parallel.py).

    mpiexec -n 2 python -m perf.step_decision [ROUNDS]

Each model trains steps that alternate between the step as it is and the step with the
decision taken out (no check, no allreduce: the step before it existed), ROUNDS x STEPS of
each, synthetic data, 32 images per rank, one thread per rank. Printed: the median step
time of each and their difference, in ms. Alternating step by step in one process keeps a
loaded machine's drift out of the difference.
"""
import statistics
import sys
import time

import numpy as np

from dynar import kernels, models, nn, optim
from dynar.dist import DataParallel, Job, SyncConfig

PER_RANK = 32
STEPS = {"lenet": 30, "alexnet": 4}
WARMUP = 3


def measure(name, variant, job, rounds):
    model = models.get(name, num_classes=10, variant=variant)
    opt = optim.SGD(model, lr=0.01, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    rng = np.random.default_rng(job.rank)
    x = rng.standard_normal((PER_RANK, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, PER_RANK)
    times = {"with": [], "without": []}
    with DataParallel(model, opt, job, SyncConfig("buckets")) as dp:
        decide = dp._decide
        for i in range(WARMUP + 2 * rounds * STEPS[name]):
            kind = "without" if i % 2 else "with"
            dp._decide = (lambda loss, stop, ranges: (stop, None, False)) \
                if kind == "without" else decide
            t0 = time.perf_counter()
            model.zero_grad(lazy=True)
            loss = crit.forward(model.forward(x), y)
            model.backward(crit.backward())
            dp.step(loss)
            if i >= WARMUP:
                times[kind].append(time.perf_counter() - t0)
        dp._decide = decide
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    job = Job.start()
    kernels.set_num_threads(1)
    for name, variant in (("lenet", "mnist"), ("alexnet", "cifar")):
        ms = measure(name, variant, job, rounds)
        if job.rank == 0:
            print(f"{name:8s} {job.world} ranks: step {ms['with']:8.3f} ms with the decision, "
                  f"{ms['without']:8.3f} ms without: {ms['with'] - ms['without']:+.3f} ms "
                  f"({100 * (ms['with'] / ms['without'] - 1):+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
