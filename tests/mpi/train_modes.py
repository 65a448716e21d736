"""Under mpiexec: train one model under each sync mode; rank 0 saves the parameters of each
and checks that every rank holds identical bytes.

argv: model outdir steps global_batch modes... (a mode may carry a wire format: dynamic:fp16)
EMULATED_NODES=k splits the ranks into k "nodes" (DYNAR_NODE_KEY) of consecutive ranks;
TRAIN_PRECISION=bf16 trains in bf16 (with DYNAR_BF16_ANY_CPU on a CPU without it)."""
import hashlib
import os
import sys

import numpy as np

from dynar.dist.job import Job
from dynar.train import TrainConfig, train

model, outdir, steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
job = Job.start()
nodes = int(os.environ.get("EMULATED_NODES", "0"))
if nodes:   # ranks 0..k-1 on "node" 0, the next on node 1, ...: contiguous blocks
    os.environ["DYNAR_NODE_KEY"] = str(job.rank * nodes // job.world)
for mode in sys.argv[5:]:
    sync, _, compress = mode.partition(":")
    extra = dict(variant="cifar", dropout=0.0) if model == "alexnet" else {}
    result = train(TrainConfig(model=model, dataset="synthetic", max_steps=steps,
                               batch_size=batch, lr=0.01, momentum=0.9, weight_decay=5e-4,
                               sync=sync, compress=compress or None, eval_every=0, threads=1,
                               precision=os.environ.get("TRAIN_PRECISION", "fp32"), **extra),
                   job)
    params = result.model.flat_params
    digests = job.comm.allgather(hashlib.sha256(params.tobytes()).hexdigest()) \
        if job.comm is not None else [None]
    if job.rank == 0:
        assert all(d == digests[0] for d in digests), f"{mode}: replicas differ: {digests}"
        np.save(os.path.join(outdir, f"{model}-{mode}-{job.world}.npy"), params)
        print(f"{mode}: {job.world} ranks, replicas identical, node replica "
              f"{result.summary['node_replica']}, precision {result.summary['precision']}",
              flush=True)
