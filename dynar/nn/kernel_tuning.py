"""Choosing each layer's kernel by timing the candidates on the machine that trains, instead
of by thresholds measured on another CPU.

Convolutions: for every distinct layer shape (input, weights, stride, padding, whether the
layer needs an input gradient, its precision) at the kernels' thread count, each algorithm
that supports it runs forward + backward a few times on scratch arrays (in bf16, as the
layer runs them); the fastest is kept, but one that would displace the thresholds' choice
is first timed again in turns with it. A bf16 layer on a CPU with bf16 convolution kernels
also times the algorithms that have them in float32 ("tapgemm/fp32"): bf16 does not pay on
every shape, and such a layer then computes in float32. Fully connected layers: each of the
three products (y, dx, dw) is timed cut among threads along each of its two axes in blocks
of each width of CUT_WIDTHS (nn/linear.py's plan), y and dx also on dynar's panel GEMM; in
bf16 on a CPU with a bf16 GEMM kernel the layer runs kernels.bf16.matmul instead, which
does not use the cuts. Results are cached in a file per machine and thread count (CPU
model, ISA, dynar's kernel build), in
$DYNAR_KERNEL_CACHE or ~/.cache/dynar/kernels, so a shape is timed once per machine;
`python -m dynar.tune --kernels` fills it ahead of a job. DYNAR_KERNEL_TUNE=0 keeps
conv_algorithms.preferred's thresholds and linear.DEFAULT_PLAN. A distributed job times on
rank 0 and every rank runs rank 0's choice (train/build.py), so ranks compute alike.
"""
import hashlib
import json
import math
import os
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np

from ..atomic_write import write_text
from ..kernels import conv, direct, im2col, linear as linear_kernels, tapgemm, winograd
from . import conv_algorithms
from .arena import mapped_empty
from .conv import ROUNDING_ALGORITHMS, Conv2d as ConvLayer, rounds_itself
from .linear import AXES, DEFAULT_PLAN, PANELS, ROWS, Linear, parse_plan
from .precision import Bf16Operands

_FORMAT, _VERSION = "dynar-kernel-choices", 2    # 2: bf16 layers' "/fp32" candidates
REPEATS = 3
NOISE = 0.05      # a lead smaller than this over the thresholds' choice does not count
BUDGET_S = 0.5    # a candidate slower than this and well behind is not timed again
# Block widths a fully connected product is timed at: narrow blocks share a small layer out
# among threads, wide ones re-pack the operand all blocks share less often (a 4096-wide
# layer's dw ran 1.3x faster in blocks of 1024 than of 64 on a Zen 2). The default plan's
# 64 comes first: a width that gives the same blocks as one timed before is skipped, so the
# default's cut keeps its name.
CUT_WIDTHS = (64, 16, 256, 1024)
# CPU features that decide which kernels are fast; the rest of /proc/cpuinfo's flags do not.
_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile",
             "amx_bf16", "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2")
# A convolution's choice "<algorithm>" or "<algorithm>/fp32": a bf16 layer computing in
# float32, where that was faster than its bf16 kernels.
IN_FP32 = "/fp32"


def enabled():
    """Whether layers are timed (DYNAR_KERNEL_TUNE, default on; 0 keeps the thresholds)."""
    value = os.environ.get("DYNAR_KERNEL_TUNE", "1").strip().lower()
    if value not in ("0", "1", "off", "on", "no", "yes", "false", "true", ""):
        raise ValueError(f"DYNAR_KERNEL_TUNE={value!r}: expected 1 (time the kernels' "
                         f"candidates) or 0 (choose by the built-in thresholds)")
    return value not in ("0", "off", "no", "false")


def cache_dir():
    env = os.environ.get("DYNAR_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dynar" / "kernels"


def machine(threads):
    """What a cached choice holds for: CPU model, architecture, the features that matter,
    the kernels' build and the thread count."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu part", "hardware") and model == "unknown":
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    build = hashlib.sha256()
    for module in (conv, direct, im2col, linear_kernels, tapgemm, winograd):
        build.update(Path(module.__file__).read_bytes())
    return {"cpu": model, "arch": platform.machine(),
            "features": sorted(flags.intersection(_FEATURES)),
            "kernels": build.hexdigest()[:16], "threads": int(threads)}


def _cache_path(about):
    digest = hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{digest}.json"


def _load(path, about):
    """The cached layer choices of `path`, {} when there are none; a damaged file is
    reported and ignored (it is timed again and rewritten)."""
    try:
        record = json.loads(path.read_text())
        ok = (record.get("format") == _FORMAT and record.get("version") == _VERSION
              and record.get("machine") == about and isinstance(record.get("layers"), dict))
        layers = record["layers"] if ok else {}
        for key, entry in layers.items():
            if not (_valid_plan(entry.get("choice")) if key.startswith("linear ") else
                    _valid_algorithm(entry.get("choice"))) or not all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                    for v in entry.get("ms", {}).values()):
                raise ValueError("a layer entry is malformed")
        return layers
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        print(f"warning: kernel choices {path} unreadable ({exc}); timing again",
              file=sys.stderr)
        return {}


def split_choice(choice):
    """(algorithm, precision or None) of a convolution's `choice`: "winograd" runs the
    model's precision, "tapgemm/fp32" the per-tap GEMMs in float32."""
    algorithm, slash, precision = choice.partition("/")
    if algorithm not in conv_algorithms.ALGORITHMS or (slash and "/" + precision != IN_FP32):
        raise ValueError(f"kernel choice {choice!r}: expected one of "
                         f"{sorted(conv_algorithms.ALGORITHMS)}, optionally + {IN_FP32!r}")
    return algorithm, precision or None


def _valid_algorithm(choice):
    try:
        split_choice(choice)
        return True
    except (ValueError, AttributeError):
        return False


def _valid_plan(plan):
    try:
        parse_plan(plan)
        return True
    except ValueError:
        return False


def _shape_key(x_shape, layer):
    dims = "x".join
    if isinstance(layer, Linear):
        return (f"linear x={dims(map(str, x_shape))} w={dims(map(str, layer.weight.shape))} "
                f"b={int(layer.bias is not None)} dx={int(layer.input_requires_grad)}")
    return (f"x={dims(map(str, x_shape))} w={dims(map(str, layer.weight.shape))} "
            f"s={dims(map(str, layer.stride))} p={dims(map(str, layer.padding))} "
            f"dx={int(layer.input_requires_grad)}"
            + (" bf16" if layer.precision == "bf16" else ""))


# The timing runs' arrays, large ones in mappings of their own: freed through malloc they
# would raise its mmap threshold and leave the heap holding memory the steps then do not
# give back (about 75 MB more peak RSS on a ResNet-18 step after tuning in the process).
def _normal(rng, shape):
    a = mapped_empty(shape)
    rng.standard_normal(dtype=np.float32, out=a)
    return a


def _zeros(shape):
    a = mapped_empty(shape)
    a.fill(0)
    return a


class _PortableRounding(Bf16Operands):
    """A bf16 layer's rounding of its operands on the portable path (nn/precision.py: what
    it rounds in forward and in backward, into scratch, every call), for timing that path
    as the layer runs it. Its scratch is its own, in mappings, and goes with it."""
    precision = "bf16"
    _arena = None

    def __init__(self, weight):
        self.weight = types.SimpleNamespace(data=weight)

    def _reuse(self, array, shape, dtype=np.float32):
        return array if array is not None and array.shape == shape else mapped_empty(shape, dtype)


def time_algorithms(x_shape, layer, repeats=REPEATS, first=None):
    """{algorithm: best seconds of forward + backward} of every algorithm that supports
    `layer` (and {"<algorithm>/fp32": ...} of a bf16 layer's, as the module says), on
    scratch arrays of its shapes (`x_shape` its input), `first` timed first.

    Bounded for big layers: each candidate's first call (which also grows the workspace,
    released after each candidate) counts as a sample; one more than BUDGET_S behind is not
    timed again, and one far behind the best so far is left at that. A leader more than
    NOISE ahead of `first` is timed again in turns with it, `repeats` rounds, before it
    counts as ahead."""
    rng = np.random.default_rng(0)
    bf16 = layer.precision == "bf16"
    x = _normal(rng, x_shape)
    w = mapped_empty(layer.weight.data.shape)
    w[...] = layer.weight.data
    b = None if layer.bias is None else np.zeros(layer.out_channels, np.float32)
    y = mapped_empty(conv.output_shape(x_shape, w.shape, layer.stride, layer.padding))
    dy = _normal(rng, y.shape)
    # bf16 kernels round what they read; the portable path is timed with the rounding
    # passes the layer makes every call.
    rounding = _PortableRounding(w)
    rounding._keep_input(x)
    dx = mapped_empty(x.shape) if layer.input_requires_grad else None
    dw, db = _zeros(w.shape), None if b is None else np.zeros_like(b)
    names = sorted(conv_algorithms.ALGORITHMS, key=lambda name: name != first)
    candidates = [(name, bf16) for name in names]
    if bf16 and conv.bf16_kernels():
        # The per-tap GEMMs on 2x2 planes ran slower in bf16 than in float32 on a Zen 4:
        # rounding and packing outweigh the products there.
        candidates += [(name + IN_FP32, False) for name in names if name in ROUNDING_ALGORITHMS]
    seconds, steps = {}, {}
    for name, on_bf16 in candidates:
        algorithm = split_choice(name)[0]
        kernel = conv_algorithms.ALGORITHMS[algorithm]
        if not kernel.supports(w.shape, layer.stride, layer.padding):
            continue
        def step(kernel=kernel, on_bf16=on_bf16,
                 portable=on_bf16 and not rounds_itself(algorithm)):
            xr, wr, dyr = x, w, dy
            if portable:
                xr, wr, _ = rounding._forward_operands(x)
            kernel.forward(y, xr, wr, b, layer.stride, layer.padding, bf16=on_bf16)
            if portable:
                dyr, xr, wr, _ = rounding._backward_operands(dy)
            kernel.backward(dx, dw, db, dyr, xr, wr, layer.stride, layer.padding, bf16=on_bf16)
        try:
            best = _best_of(step, repeats, seconds)
        finally:
            # A losing candidate's workspace need is not the run's: give it back.
            conv.release_workspace()
        seconds[name], steps[name] = best, step
    leader = min(seconds, key=seconds.get, default=None)
    if first in seconds and leader != first and seconds[first] > seconds[leader] * (1 + NOISE):
        # Each candidate was timed in its own window: on a shared machine a burst of load
        # in the prior's window hands the lead to another (seen on a noisy Xeon:
        # docs/notes/2026-12-06-xeon-scalar-passes.md). The two run again in turns, so that
        # a burst slows both, before the prior is left.
        try:
            for _ in range(repeats):
                for name in (first, leader):
                    seconds[name] = min(seconds[name], _timed(steps[name]))
        finally:
            conv.release_workspace()
    return seconds


def time_cuts(x_shape, layer, repeats=REPEATS):
    """{"y=out/64": best seconds, ...}: each product of fully connected `layer` (input
    `x_shape`) cut each way, the rest of its call at DEFAULT_PLAN's cut; a width that gives
    the same blocks as one before it is not timed. Bounded as time_algorithms."""
    rng = np.random.default_rng(0)
    x = _normal(rng, x_shape)
    w = layer.weight.data
    b = None if layer.bias is None else np.zeros(layer.out_features, np.float32)
    y = mapped_empty((x_shape[0], layer.out_features))
    dy = _normal(rng, y.shape)
    dx = mapped_empty(x.shape)
    dw, db = _zeros(w.shape), None if b is None else np.zeros_like(b)
    default = parse_plan(DEFAULT_PLAN)
    calls = {"y": lambda cut: linear_kernels.linear_forward(y, x, w, b, cut),
             "dx": lambda cut: linear_kernels.linear_backward(dx, dw, None, dy, x, w, cut,
                                                              default["dw"]),
             "dw": lambda cut: linear_kernels.linear_backward(None, dw, db, dy, x, w,
                                                              default["dx"], cut)}
    extents = {"y": y.shape, "dx": x.shape, "dw": w.shape}
    seconds = {}
    try:
        for product, axes in AXES.items():
            if product == "dx" and not layer.input_requires_grad:
                continue
            timed = {}
            for along, axis in axes.items():
                blocks_seen = set()
                for width in CUT_WIDTHS:
                    blocks = _block_count(extents[product], axis, width)
                    if blocks in blocks_seen:
                        continue
                    blocks_seen.add(blocks)
                    best = _best_of(lambda: calls[product]((axis, width)), repeats, timed)
                    timed[f"{product}={along}/{width}"] = best
            seconds.update(timed)
    finally:
        linear_kernels.release_workspace()     # the panel cuts' packed batch
    return seconds


def _block_count(shape, axis, width):
    """Blocks of a product's output `shape` a cut makes: ROWS splits its rows, COLS and
    PANELS its columns, PANELS in whole strips of the panel GEMM."""
    if axis == PANELS:
        strip = linear_kernels.PANEL_STRIP_FLOATS
        width = -(-width // strip) * strip
    return -(-shape[0 if axis == ROWS else 1] // width)


def _timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _best_of(call, repeats, rivals):
    """The best of `call`'s times over 1 + `repeats` calls, fewer when it falls far behind
    the best of `rivals` (time_algorithms' bound)."""
    best, calls = math.inf, 0
    while calls <= repeats:
        best, calls = min(best, _timed(call)), calls + 1
        leader = min(rivals.values(), default=math.inf)
        if best > 3 * leader or (best > 1.5 * leader and best > BUDGET_S):
            break                           # far behind: no need to be precise
    return best


def rule(x_shape, layer):
    """The choice without timing: the thresholds', or the default plan."""
    if isinstance(layer, Linear):
        return DEFAULT_PLAN
    return conv_algorithms.preferred(x_shape, layer.weight.shape, layer.stride, layer.padding)


def _choose_plan(ms):
    """The plan of each product's fastest cut (DEFAULT_PLAN's within NOISE of it kept)."""
    prior = dict(part.split("=") for part in DEFAULT_PLAN.split())
    chosen = []
    for product in AXES:
        times = {k.partition("=")[2]: v for k, v in ms.items() if k.startswith(product + "=")}
        cut = _fastest(times, prior[product]) if times else prior[product]
        chosen.append(f"{product}={cut}")
    return " ".join(chosen)


def _fastest(ms, prior):
    """The fastest algorithm of `ms`, unless the thresholds' `prior` is within NOISE of it:
    a near tie is decided the same way on every machine, not by the timing's noise. Float32
    in a bf16 layer needs a lead of NOISE over its bf16 candidates too."""
    best = min(ms, key=ms.get)
    in_bf16 = {name: t for name, t in ms.items() if not name.endswith(IN_FP32)}
    if best not in in_bf16 and in_bf16:
        if min(in_bf16.values()) <= ms[best] * (1 + NOISE):
            return _fastest(in_bf16, prior)
        prior += IN_FP32    # among float32's, the thresholds' algorithm is the prior
    return prior if ms.get(prior, math.inf) <= ms[best] * (1 + NOISE) else best


def tuned_layers(model, batch):
    """[(name, layer, input shape)] of the model's "auto" convolutions and its fully
    connected layers at `batch` images, the convolutions' by one forward of one image of
    zeros in eval mode (no statistics or random state touched; a batch's worth of
    activations would be held until the first training step)."""
    was_training = model.training
    model.eval()
    try:
        model.forward(np.zeros((1, *model.input_shape), np.float32))
    finally:
        model.train(was_training)
    return [(name, m, (batch,) + tuple(m._x_shape[1:])) for name, m in model.named_modules()
            if isinstance(m, ConvLayer) and m.algorithm == "auto"] + \
        [(name, m, (batch, m.in_features)) for name, m in model.named_modules()
         if isinstance(m, Linear)]


def kind(layer):
    """What a record's `choice` is for `layer`: "linear" (a plan of cuts) or "conv" (an
    algorithm, "<algorithm>/fp32" for a bf16 layer that computes in float32)."""
    return "linear" if isinstance(layer, Linear) else "conv"


def choose(model, batch, threads, tune=None):
    """[{layer, kind, shape, choice, source, ms}] for each "auto" convolution and each fully
    connected layer of `model` trained at `batch` images per step and `threads` kernel
    threads: timed here ("measured"), from the cache ("cached"), or by the thresholds
    ("rule", when tuning is off)."""
    tune = enabled() if tune is None else tune
    about = machine(threads) if tune else None
    path = _cache_path(about) if tune else None
    cached = _load(path, about) if tune else {}
    found, records = {}, []
    for name, layer, x_shape in tuned_layers(model, batch):
        key = _shape_key(x_shape, layer)
        if not tune:
            records.append({"layer": name, "kind": kind(layer), "shape": key,
                            "choice": rule(x_shape, layer), "source": "rule"})
            continue
        source = "cached" if key in cached else "measured"
        if key not in cached and key not in found:
            if isinstance(layer, Linear):
                ms = {k: 1e3 * v for k, v in time_cuts(x_shape, layer).items()}
                choice = _choose_plan(ms)
            else:
                prior = rule(x_shape, layer)
                ms = {k: 1e3 * v
                      for k, v in time_algorithms(x_shape, layer, first=prior).items()}
                choice = _fastest(ms, prior)
            found[key] = {"choice": choice, "ms": ms}
        entry = cached.get(key) or found[key]
        records.append({"layer": name, "kind": kind(layer), "shape": key,
                        "choice": entry["choice"], "source": source, "ms": entry["ms"]})
    if found:
        _save(path, about, {**_load(path, about), **found})
    return records


def _save(path, about, layers):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({"format": _FORMAT, "version": _VERSION,
                                     "machine": about, "layers": layers}, indent=1))
    except OSError as exc:      # a read-only home: the choices hold for this run only
        print(f"warning: cannot keep kernel choices in {path}: {exc.strerror or exc}",
              file=sys.stderr)


def apply(model, records):
    """Set each convolution named in `records` to its chosen algorithm (and to float32 where
    the choice says so), each fully connected layer to its plan."""
    layers = dict(model.named_modules())
    for record in records:
        layer = layers[record["layer"]]
        if isinstance(layer, Linear):
            layer.plan = record["choice"]
        else:
            layer.algorithm, precision = split_choice(record["choice"])
            if precision:
                layer.precision = precision
