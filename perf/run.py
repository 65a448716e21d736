"""Benchmark entry point: `python -m perf <suite> [--quick]` or `python perf/run.py <suite>`.

Each suite prints a Markdown table and writes perf/results/<suite>.json with the machine's
facts and every raw sample. Run with the machine otherwise idle; numbers are ratios against
peers measured in the same run (docs/DESIGN.md, "Benchmark protocol").
"""
import argparse
import importlib
import os
import sys
import time

SUITES = ["kernels", "models", "allreduce", "dist", "cluster", "scale", "data",
          "batchnorm", "bf16"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=SUITES + ["all", "report"],
                        help="which benchmark to run (`report` refreshes "
                             "docs/notes/perf-tables.md from the last results)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args(argv)
    from perf import harness
    harness.warn_if_blas_pinned()
    for suite in SUITES + ["report"] if args.suite == "all" else [args.suite]:
        print(f"## {suite}\n", flush=True)
        start = time.monotonic()
        importlib.import_module(f"perf.{suite}").run(quick=args.quick)
        print(f"\n({suite}: {time.monotonic() - start:.0f} s)\n", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
