"""python -m dynar.tune: measure dynar's allreduce algorithms on this job's ranks and hosts,
fit their costs, and save a tuning file that `--sync dynamic` training jobs of the same
shape (ranks, ranks per node, MPI library, interconnect; on these hosts or any others)
load instead of tuning briefly themselves.

Run it under the same launcher and layout as training, e.g.
    mpiexec -n 8 --map-by ppr:2:node python -m dynar.tune
When the nodes run more than one rank each, training shares one replica per node and only
allreduces among nodes, so that is what is tuned (by one rank per node). Files go to
$DYNAR_TUNE_DIR (default ~/.cache/dynar/tune), or --dir.

python -m dynar.tune --kernels --model M [--variant V] --batch-size B [--threads T] instead
times each convolution algorithm, and each way to cut a fully connected layer among threads,
on every layer shape of the model (B images per rank, as a rank trains) and keeps the
fastest in the kernel cache training reads (nn/kernel_tuning.py:
$DYNAR_KERNEL_CACHE, default ~/.cache/dynar/kernels), so that a job starts without timing.
No MPI: run it on one node of the kind the job will run on.
"""
import argparse
import sys

from .dist import node_replica, tuning
from .dist.collective import Collective
from .dist.job import Job, wait_politely
from .nn.precision import PRECISIONS


def _sizes(text):
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts, got {text!r}")
    if len(sizes) < 2 or min(sizes) <= 0:
        raise argparse.ArgumentTypeError("need at least two positive message sizes")
    return sizes


def build_parser():
    p = argparse.ArgumentParser(prog="python -m dynar.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_sizes, default=tuning.FULL_SIZES, metavar="B1,B2,...",
                   help="message sizes in bytes (default 4 B ... 256 MB, powers of 4)")
    p.add_argument("--repeats", type=int, default=tuning.FULL_REPEATS,
                   help="timed calls per algorithm and size (median taken)")
    kernels = p.add_argument_group("layer kernels (--kernels)")
    kernels.add_argument("--kernels", action="store_true",
                         help="time the convolution algorithms and fully connected layers' "
                              "cuts of --model instead")
    kernels.add_argument("--model", help="the model whose layers to time (dynar.models)")
    kernels.add_argument("--variant", help="its input size variant (cifar, imagenet, ...)")
    kernels.add_argument("--batch-size", type=int, default=32,
                         help="images per rank and step, as the job will train (default 32)")
    kernels.add_argument("--threads", type=int,
                         help="kernel threads per rank (default: this process's share)")
    kernels.add_argument("--precision", choices=PRECISIONS, default="fp32",
                         help="the --precision the job will train in (default fp32)")
    p.add_argument("--dir", help="where to write the tuning file (default $DYNAR_TUNE_DIR "
                                 "or ~/.cache/dynar/tune)")
    return p


def tune_kernels(args):
    """--kernels: every layer shape of the model timed, the cache filled; returns the
    exit status."""
    from . import kernels, models
    from .nn import kernel_tuning, precision
    if not args.model or args.batch_size < 1 or (args.threads is not None and args.threads < 1):
        print("error: --kernels needs --model, a --batch-size >= 1 and --threads >= 1",
              file=sys.stderr)
        return 2
    options = {"variant": args.variant} if args.variant else {}
    try:
        model = models.get(args.model, num_classes=10, **options)
    except (KeyError, ValueError, TypeError) as exc:
        print(f"error: --model {args.model}: {exc}", file=sys.stderr)
        return 2
    threads = args.threads or Job.start().default_threads()[0]
    ran, note = precision.resolve(args.precision)
    if note:
        print(note)
    precision.set_precision(model, ran)
    with kernels.settings_kept():
        kernels.set_num_threads(threads)
        kernels.set_flush_denormals(True)
        records = kernel_tuning.choose(model, args.batch_size, threads, tune=True)
    print(f"{args.model} at {args.batch_size} images x {threads} thread(s), "
          f"ms of forward + backward:")
    for r in records:
        print(f"  {r['layer']:<22} {r['choice']} ({r['source']})")
        line = "   "
        for k, v in sorted(r["ms"].items()):
            if len(line) > 80:
                print(line)
                line = "   "
            line += f"  {k} {v:.2f}"
        print(line)
    print(f"kept in {kernel_tuning.cache_dir()}")
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.kernels:
        return tune_kernels(args)
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    job = Job.start()
    if not job.distributed:
        print("error: nothing to tune on one process; run under mpiexec with 2 or more ranks",
              file=sys.stderr)
        return 2
    say = print if job.rank == 0 else (lambda *a, **k: None)
    comm = job.comm
    if node_replica.wanted(comm):
        # Training jobs of this shape keep one replica per node and allreduce each node's
        # parts only among nodes: tune that, on the node leaders, while the others wait.
        node, cross = node_replica.split(comm)
        leader = node.Get_rank() == 0
        node.Free()
        if cross.Get_size() == 1 or not leader:
            if cross.Get_size() == 1:
                say("one node: its ranks share one replica of the model and send no "
                    "gradients, so there is nothing to tune")
            cross.Free()
            wait_politely(job.comm)
            return 0
        comm = cross
        say(f"{job.world} ranks share one replica per node: tuning the allreduce among the "
            f"{cross.Get_size()} nodes")
    try:
        collective = Collective(comm)
        say(f"tuning {collective.size} ranks ({collective.local_size} per node, {collective.nodes} "
            f"node(s)): {len(args.sizes)} sizes x 5 algorithms x {args.repeats} repeats")
        model, path, _ = tuning.tune(
            collective, args.sizes, args.repeats, args.dir,
            progress=lambda s: say(f"  {s['algorithm']:>18} {s['nbytes']:>11,} B "
                                   f"{1e6 * s['seconds']:>12.1f} us", flush=True))
        collective.free()
    except Exception as exc:  # noqa: BLE001 - one line per failure, and the job ends
        job.abort(f"error: {exc}")
    if comm is not job.comm:
        comm.Free()
        wait_politely(job.comm)    # the leaders are done: release the waiting ranks
    say("fitted time = alpha + beta * bytes per algorithm:")
    for algorithm in model.algorithms:
        cost = model.cost(algorithm)
        bandwidth = f"{1 / cost.beta / 1e9:8.2f} GB/s" if cost.beta > 0 else "unbounded"
        say(f"  {algorithm:>18}: alpha {1e6 * cost.alpha:8.2f} us, 1/beta {bandwidth}")
    if model.link is not None:
        link = model.link
        say(f"link model: alpha {1e6 * link.alpha:.2f} us, beta {1e9 * link.beta:.4f} ns/B, "
            f"gamma {1e9 * link.gamma:.4f} ns/B")
    if path is not None:
        say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
