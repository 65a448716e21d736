"""Command line of the emulated cluster; see `python -m perf.cluster --help`."""
import argparse
import os
import subprocess
import sys

from . import bandwidth, cluster, network, slurm, suite
from .errors import ClusterError

EPILOG = """examples (as root):
  python -m perf.cluster exec --hosts 4 --ranks-per-host 1 --rate 10gbit -- \\
      python -m dynar.train --model lenet
  python -m perf.cluster slurm --hosts 2 -- bash     # sbatch, srun, squeue work in there
  python -m perf.cluster check --hosts 2 --rate 1gbit
  python -m perf.cluster cleanup"""


def _layout_args(parser, default_hosts):
    parser.add_argument("--hosts", type=int, default=default_hosts,
                        help=f"emulated hosts (default {default_hosts})")
    parser.add_argument("--rate", default="1gbit",
                        help="link rate per host, tc notation: 500mbit, 1gbit, 10gbit, 25gbit "
                             "(default 1gbit)")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m perf.cluster", epilog=EPILOG,
        description="Emulated multi-node cluster: network namespaces joined by a bridge, "
                    "links shaped with tc tbf, MPI ranks launched inside them.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("exec", help="run a command under mpiexec on an emulated cluster; "
                                    "its exit code is forwarded")
    _layout_args(p, 2)
    p.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks per host (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before mpiexec is stopped")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p = sub.add_parser("slurm", help="run a command beside a Slurm cluster of the emulated "
                                     "hosts (SLURM_CONF set); its exit code is forwarded")
    _layout_args(p, 2)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p = sub.add_parser("check", help="measure host-to-host TCP bandwidth against the "
                                     "configured rate, then verify the cleanup")
    _layout_args(p, 2)
    p.add_argument("--seconds", type=float, default=2.0, help="transfer time (default 2)")
    p = sub.add_parser("cleanup", help="remove what killed runs left behind")
    p.add_argument("--force", action="store_true",
                   help="also remove clusters whose owner process is still running")
    args = parser.parse_args(argv)
    if args.command in ("exec", "slurm"):
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not args.cmd:
            parser.error(f"{args.command}: give the command after `--`")
    if args.command == "check" and args.seconds <= 0:
        parser.error("check: --seconds must be > 0")
    return args


def cmd_exec(args):
    with cluster.Cluster(args.hosts, args.ranks_per_host, args.rate) as c:
        try:
            code = c.run(args.cmd, timeout=args.timeout, capture=False).returncode
        except subprocess.TimeoutExpired:
            print(f"python -m perf.cluster: error: stopped after --timeout {args.timeout:g} s",
                  file=sys.stderr)
            return 124  # as timeout(1)
    return 128 - code if code < 0 else code  # killed by signal N: exit 128+N, as a shell does


def cmd_slurm(args):
    with slurm.SlurmCluster(args.hosts, args.rate) as s:
        print(f"python -m perf.cluster: Slurm cluster {s.run_id} up: nodes "
              f"{', '.join(s.namespaces)}; SLURM_CONF={s.conf}", file=sys.stderr, flush=True)
        code = subprocess.run(args.cmd, env=s.env()).returncode
    return 128 - code if code < 0 else code


def cmd_check(args):
    if args.hosts < 2:
        raise ClusterError("check needs --hosts >= 2 (it measures from host 0 to host 1)")
    with cluster.Cluster(args.hosts, 1, args.rate) as c:
        run_id = c.run_id
        result = bandwidth.measure(c, args.seconds)
    bits = network.parse_rate(args.rate)
    ratio = result["gbit_per_s"] * 1e9 / bits
    ok = abs(ratio - 1) <= suite.TOLERANCE
    print(f"host 0 -> host 1: {result['gbit_per_s']:.3f} Gbit/s over {result['seconds']:.2f} s, "
          f"configured {network.format_rate(bits)}: {ratio:.1%} "
          f"({'within' if ok else 'OUTSIDE'} {suite.TOLERANCE:.0%}; one TCP stream carries at "
          f"most {network.TCP_GOODPUT_FRACTION:.1%})")
    left = run_id in cluster.leftovers()
    print("cleanup: " + ("LEFTOVERS remain (run `python -m perf.cluster cleanup`)" if left
                         else "nothing left behind"))
    return 0 if ok and not left else 1


def cmd_cleanup(args):
    if os.geteuid() != 0:
        raise ClusterError("cleanup needs root (it deletes network namespaces and links)")
    removed, kept = cluster.cleanup_leftovers(force=args.force)
    print(f"removed {len(removed)} leftover run(s)" + (f": {', '.join(removed)}" if removed else ""))
    if kept:
        print(f"kept {len(kept)} run(s) whose owner is still running: {', '.join(kept)} "
              f"(--force removes them too)")
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {"exec": cmd_exec, "slurm": cmd_slurm, "check": cmd_check,
                "cleanup": cmd_cleanup}[args.command](args)
    except ClusterError as e:
        print(f"python -m perf.cluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # SIGTERM/SIGHUP, turned into SystemExit while a cluster is up
        return e.code


if __name__ == "__main__":
    sys.exit(main())
