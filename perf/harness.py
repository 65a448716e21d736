"""What every benchmark suite shares: the peer protocol, machine facts, and result files.

Protocol (docs/DESIGN.md, "Benchmark protocol"): peers are measured in the same run,
alternating A, B, A, B so that machine noise hits both alike; each figure is a median after
warm-up; comparisons are reported as ratios, never as lone absolute times.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from dynar.atomic_write import write_text

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def alternate(candidates, repeats, warmup=3):
    """Time each zero-argument callable in `candidates` (name -> fn) `repeats` times,
    interleaved round by round after `warmup` untimed rounds. Returns name -> samples (s)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def median(values):
    return statistics.median(values)


def geometric_mean(values):
    values = list(values)
    product = 1.0
    for v in values:
        product *= v
    return product ** (1.0 / len(values))


def gemm_ceiling_gflops(repeats=5, size=2048):
    """float32 GFLOP/s of numpy `a @ b` at size^3: the compute ceiling (docs/DESIGN.md)."""
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    times = alternate({"gemm": lambda: a @ b}, repeats, warmup=1)["gemm"]
    return 2.0 * size ** 3 / median(times) / 1e9, times


def _cpu_model():
    """The CPU's name, with its family and model where the name alone does not tell the
    generation (a virtual machine's "AMD EPYC" is Zen 3, 4 or 5)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not line.strip():
                    break                               # the first processor is enough
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    name = (fields.get("model name") or fields.get("CPU part") or fields.get("Model")
            or platform.processor() or platform.machine())
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _cpu_features():
    """The features that decide which kernels are fast (those the kernel-choice cache keys)."""
    from dynar.nn.kernel_tuning import machine
    return machine(1)["features"]


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info():
    """CPU, cores, BLAS libraries (with the kernel OpenBLAS chose), library versions, commit."""
    import numpy
    import threadpoolctl
    info = {
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "machine": platform.machine(),
        "cores_available": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "git_commit": _git_commit(),
        "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
        "blas": [{k: lib.get(k) for k in ("internal_api", "version", "architecture",
                                           "num_threads", "filepath")}
                 for lib in threadpoolctl.threadpool_info() if lib.get("user_api") == "blas"],
    }
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    info["mpi"] = _mpi_library()
    return info


def _mpi_library():
    """The MPI library mpi4py loads, read without initializing MPI in this process (the
    harness launches ranks with mpiexec; MPI_Get_library_version may precede MPI_Init)."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        return {"mpi4py": mpi4py.__version__,
                "library": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00")}
    except ImportError:
        return None


def warn_if_blas_pinned():
    """Some machines here set OPENBLAS_CORETYPE for old-OpenBLAS safety; it slows a current
    OpenBLAS (and the GEMM ceiling). Benchmarks should run without it (docs/PERFORMANCE.md)."""
    pinned = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    if pinned:
        print(f"note: {', '.join(pinned)} set: OpenBLAS runs a pinned kernel; for the "
              f"published numbers run `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "
              f"python -m perf ...`", file=sys.stderr)


def write_result(suite, payload):
    """Write perf/results/<suite>.json (machine info + payload) and return its path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{suite}.json")
    doc = {"suite": suite, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": machine_info(), **payload}
    write_text(path, json.dumps(doc, indent=1))
    return path


def format_table(header, rows):
    """A Markdown table (prints well on a terminal and pastes into the docs)."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
