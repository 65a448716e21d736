"""Under mpiexec: train each BatchNorm model with each --batchnorm mode; rank 0 saves the
final state_dict (parameters and BatchNorm buffers) of each, and every rank checks that the
replicas hold identical parameters (and, with global statistics, identical buffers).

argv: outdir steps global_batch models... (a model may carry a mode: resnet18:local; the
default is global). EXTRA (env, JSON) adds TrainConfig fields."""
import hashlib
import json
import os
import sys

import numpy as np

from dynar.dist import runtime
from dynar.dist.job import Job
from dynar.train import TrainConfig, train

outdir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
extra = json.loads(os.environ.get("EXTRA", "{}"))
job = Job.start()
for spec in sys.argv[4:]:
    model, _, mode = spec.partition(":")
    mode = mode or "global"
    settings = dict(model=model, variant="cifar", dataset="synthetic", max_steps=steps,
                    batch_size=batch, lr=0.01, momentum=0.9, weight_decay=5e-4,
                    schedule="constant", warmup_epochs=0, batchnorm=mode, eval_every=0,
                    threads=1, sync="buckets", bucket_mb=1.0, seed=3)
    result = train(TrainConfig(**dict(settings, **extra)), job)
    state = result.model.state_dict()
    buffers = [name for name in state if "running" in name]
    mine = {"params": hashlib.sha256(result.model.flat_params.tobytes()).hexdigest(),
            "buffers": hashlib.sha256(b"".join(state[n].tobytes() for n in buffers)).hexdigest()}
    everyone = job.comm.allgather(mine) if job.comm is not None else [mine]
    assert all(d["params"] == mine["params"] for d in everyone), f"{spec}: replicas differ"
    if mode == "global":
        assert all(d["buffers"] == mine["buffers"] for d in everyone), \
            f"{spec}: BatchNorm statistics differ between ranks"
    if job.rank == 0:
        np.savez(os.path.join(outdir, f"{model}-{mode}-{job.world}.npz"), **state)
        level = runtime.mpi().Query_thread() if job.comm is not None else None
        print(f"{spec}: {job.world} ranks, replicas identical, node replica "
              f"{result.summary['node_replica']}, batchnorm {result.summary['batchnorm']}, "
              f"thread level {level}", flush=True)
