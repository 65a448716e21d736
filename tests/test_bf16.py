"""bf16 mixed precision: the rounding every path shares, which CPUs have bf16 instructions,
the layers computing on bf16 operands, whole models against PyTorch's autocast, and
--precision in training runs.

Most tests here need no bf16 instructions: the layers' bf16 path is the portable one (float32
kernels on bf16-rounded operands), which DYNAR_BF16_ANY_CPU runs on any CPU, and the bf16
GEMM's portable kernel, the reference for the others. A kernel this CPU cannot run is
skipped, naming the instructions it needs (BFMMLA runs under `qemu-aarch64 -cpu max` in the
ARM check, docs/ARM.md; AMX and AVX512_BF16 on such an x86 CPU)."""
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from dynar import checkpoint, kernels, models, nn
from dynar.kernels import bf16, conv, im2col
from dynar.nn import conv_algorithms, precision
from dynar.train import TrainConfig, train
from support.markers import require_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_bf16_bits(x):
    """The bf16 bits of float32 `x` by the rule (include/bf16.h), computed apart from the
    kernel: the two bf16 neighbours of each value compared in float64, ties to the even."""
    bits = x.view(np.uint32).astype(np.uint64)
    sign = bits & 0x80000000
    magnitude = bits & 0x7FFFFFFF
    down = magnitude & 0x7FFF0000
    up = down + 0x10000

    def value_of(float_bits):
        return float_bits.astype(np.uint32).view(np.float32).astype(np.float64)

    with np.errstate(all="ignore"):     # NaN and inf inputs: decided apart below
        value = np.abs(x.astype(np.float64))
        # The bf16 above the largest finite one, were the exponent wider: 2^128.
        up_value = np.where(up == 0x7F800000, 2.0 ** 128, value_of(np.minimum(up, 0x7F800000)))
        above, below = up_value - value, value - value_of(down)
    take_up = (above < below) | ((above == below) & ((down >> 16) & 1 == 1))
    rounded = np.where(take_up, up, down) >> 16
    nan = magnitude > 0x7F800000
    subnormal = magnitude < 0x00800000
    result = np.where(nan, (bits >> 16) | 0x40, np.where(subnormal, 0, rounded) | (sign >> 16))
    return result.astype(np.uint16)


def special_values(rng):
    """float32 values of every class the rule names, ties in both directions included."""
    upper = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    ties = upper | 0x8000                            # exactly halfway: even and odd kept parts
    near = upper | rng.choice(np.array([0x7FFF, 0x8001, 0x0001, 0xFFFF], np.uint32), 4096)
    named = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # around the overflow
                      0x7F800000, 0xFF800000, 0, 0x80000000,            # inf, zeros
                      0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFBFFFFF,   # NaNs, quiet and not
                      0x00000001, 0x807FFFFF, 0x00800000, 0x80800000],  # subnormal, smallest
                     np.uint32)
    random = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([ties, near, named, random]).view(np.float32)


def test_rounding_follows_the_rule_on_every_kind_of_value(rng):
    x = special_values(rng)
    got = np.empty(x.shape, np.uint16)
    bf16.to_bf16(got, x)
    want = reference_bf16_bits(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got[i]), hex(want[i]))
                           for i in bad[:5]]
    # NaN stays NaN with its sign; a subnormal becomes a zero of its sign.
    back = np.empty(x.shape, np.float32)
    bf16.to_float32(back, got)
    assert np.array_equal(np.isnan(back), np.isnan(x))
    assert np.array_equal(np.signbit(back), np.signbit(x))


def test_float_round_trip_and_rounding_in_place_agree(rng):
    x = special_values(rng)
    halves = np.empty(x.shape, np.uint16)
    bf16.to_bf16(halves, x)
    back = np.empty_like(x)
    bf16.to_float32(back, halves)
    rounded = x.copy()
    bf16.round_to_bf16(rounded, rounded)
    assert np.array_equal(rounded.view(np.uint32), back.view(np.uint32))
    assert not np.any(rounded.view(np.uint32) & 0xFFFF)


@pytest.mark.torch
def test_rounding_matches_pytorch_on_finite_normal_values(rng):
    torch = require_torch()
    x = special_values(rng)
    magnitude = np.abs(x)
    x = x[np.isfinite(x) & (magnitude >= np.finfo(np.float32).tiny)]
    got = np.empty(x.shape, np.uint16)
    bf16.to_bf16(got, x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)


def test_conversions_do_not_depend_on_the_thread_count(rng):
    x = rng.standard_normal(200_003).astype(np.float32) * 1e3   # chunks and a ragged end
    results = []
    before = kernels.get_num_threads()
    try:
        for threads in (1, 2):
            kernels.set_num_threads(threads)
            out = np.empty(x.shape, np.uint16)
            bf16.to_bf16(out, x)
            results.append(out)
    finally:
        kernels.set_num_threads(before)
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[0], reference_bf16_bits(x))


def test_bad_arguments_are_refused_naming_them():
    x = np.zeros((4, 5), np.float32)
    with pytest.raises(TypeError, match="out: expected dtype uint16"):
        bf16.to_bf16(np.zeros((4, 5), np.float32), x)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        bf16.to_bf16(np.zeros((4, 5), np.uint16), x.astype(np.float64))
    with pytest.raises(ValueError, match="out"):
        bf16.round_to_bf16(np.zeros((4, 6), np.float32), x)
    with pytest.raises(ValueError, match="out must not overlap x"):
        bf16.round_to_bf16(x.reshape(-1)[1:], x.reshape(-1)[:-1])
    with pytest.raises(ValueError, match="C-contiguous"):
        bf16.to_float32(np.zeros((5, 4), np.float32), np.zeros((4, 5), np.uint16).T)


def _x86_flags():
    """The kernel's view of this CPU's features: /proc/cpuinfo's `flags`."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split())
    return set()


def _aarch64_hwcap2():
    """AT_HWCAP2 from /proc/self/auxv, (type, value) pairs of 64-bit words. (qemu-user
    emulates this file for the guest, but not /proc/cpuinfo.)"""
    with open("/proc/self/auxv", "rb") as f:
        words = np.frombuffer(f.read(), np.uint64).reshape(-1, 2)
    at_hwcap2 = 26
    return int(next((value for kind, value in words if kind == at_hwcap2), 0))


def test_cpu_features_match_what_the_kernel_reports():
    features = bf16.cpu_features()
    machine = platform.machine()
    if machine == "x86_64":
        flags = _x86_flags()
        assert ("avx512_bf16" in features) == ({"avx512_bf16", "avx512f", "avx512bw"} <= flags), flags
        # AMX also needs the kernel to grant the tile state, which it may refuse.
        assert "amx_bf16" not in features or {"amx_bf16", "amx_tile"} <= flags
        assert "aarch64_bf16" not in features
    elif machine == "aarch64":
        hwcap2_bf16 = 1 << 14
        assert features == (("aarch64_bf16",) if _aarch64_hwcap2() & hwcap2_bf16 else ())
    assert bf16.cpu_features() == features          # asking again changes nothing


def test_precision_resolves_by_the_cpu_and_the_override(monkeypatch):
    monkeypatch.delenv(precision.ANY_CPU_VARIABLE, raising=False)
    assert precision.resolve("fp32") == ("fp32", None)
    ran, note = precision.resolve("bf16")
    if bf16.cpu_features():
        assert ran == "bf16" and "bf16 instructions" in note
    else:
        assert ran == "fp32" and "has no bf16 instructions" in note and "running fp32" in note
    monkeypatch.setenv(precision.ANY_CPU_VARIABLE, "1")
    assert precision.resolve("bf16")[0] == "bf16"
    with pytest.raises(ValueError, match="precision: expected one of"):
        precision.resolve("fp16")


def _rounded(a):
    out = np.empty_like(a)
    bf16.round_to_bf16(out, a)
    return out


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def _conv64(x, w, b, stride, padding):
    """The float64 convolution (im2col's float64 instantiation)."""
    y = np.empty(conv.output_shape(x.shape, w.shape, stride, padding))
    im2col.forward(y, x, w, b, stride, padding)
    return y


CONV_CASES = [("gemm", 1), ("gemm", 2), ("winograd", 1), ("direct", 1), ("tapgemm", 1)]
# What each of the convolutions' bf16 kernels needs (kernels/conv.BF16_KERNELS).
CONV_KERNEL_NEEDS = {"amx_bf16": "x86 AMX-BF16 (tile state granted by Linux) and AVX512_BF16",
                     "avx512_bf16": "x86 AVX512_BF16 and AVX512BW",
                     "bfmmla": "aarch64 FEAT_BF16 (BFMMLA)"}


@pytest.fixture(params=list(CONV_KERNEL_NEEDS))
def conv_bf16_kernel(request):
    """The convolutions' bf16 products on each kernel in turn, skipped (saying what it
    needs) where this CPU cannot run it."""
    yield from _convolutions_on(request.param)


@pytest.fixture(params=[*CONV_KERNEL_NEEDS, "portable"])
def conv_bf16_path(request):
    """As conv_bf16_kernel, and on the portable path: float32 kernels on operands the layer
    rounds, which every CPU runs."""
    yield from _convolutions_on(request.param)


def _convolutions_on(name):
    if name != "portable" and name not in _conv_kernels_here():
        pytest.skip(f"the convolutions' {name} kernel needs {CONV_KERNEL_NEEDS[name]}, which "
                    f"this CPU ({platform.machine()}) does not have")
    previous = conv.bf16_kernel(name)
    yield name
    conv.bf16_kernel(previous)


def _conv_kernels_here():
    """The convolutions' bf16 kernels this CPU runs."""
    runs = []
    previous = conv.bf16_kernel()
    for name in CONV_KERNEL_NEEDS:
        try:
            conv.bf16_kernel(name)
            runs.append(name)
        except ValueError:
            pass
    conv.bf16_kernel(previous)
    return runs


def test_every_conv_kernel_is_listed_and_runs_where_the_cpu_has_it():
    assert set(CONV_KERNEL_NEEDS) | {"portable"} == set(conv.BF16_KERNELS)
    features = bf16.cpu_features()
    here = _conv_kernels_here()
    assert ("avx512_bf16" in here) == ("avx512_bf16" in features)
    assert ("amx_bf16" in here) == ({"amx_bf16", "avx512_bf16"} <= set(features))
    assert ("bfmmla" in here) == ("aarch64_bf16" in features)
    assert conv.bf16_kernel() == (here[0] if here else "portable")  # the fastest by default
    assert conv.bf16_kernels() == bool(here)
    with pytest.raises(ValueError, match="bf16 kernel 'tiles': this CPU runs"):
        conv.bf16_kernel("tiles")


def _bf16_step(layer, x, rng, rounded=True):
    """(y, dx, x, w, dy in float64) of one forward and backward of `layer` in bf16, its
    parameter gradients starting at zero; x, w and dy rounded to bf16 unless not `rounded`."""
    layer.precision = "bf16"
    y = layer.forward(x).copy()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    layer.weight.grad = np.zeros_like(layer.weight.data)
    layer.bias.grad = np.zeros_like(layer.bias.data)
    dx = layer.backward(dy).copy()
    operands = ((_rounded(a) if rounded else a).astype(np.float64)
                for a in (x, layer.weight.data, dy))
    return (y, dx, *operands)


@pytest.mark.parametrize("algorithm, stride", CONV_CASES)
def test_bf16_convolution_computes_on_rounded_operands_in_float32(algorithm, stride,
                                                                  conv_bf16_path, rng):
    layer = nn.Conv2d(24, 32, 3, stride=stride, padding=1, generator=rng)
    layer.algorithm = algorithm
    x = rng.standard_normal((3, 24, 10, 10)).astype(np.float32)
    y, dx, *operands = _bf16_step(layer, x, rng, rounded=False)
    x64, w64, dy64 = (_bf16_values(a) for a in operands)
    # float64 on the bf16-rounded operands: what the layer must match to float32 sums.
    b64 = layer.bias.data.astype(np.float64)
    want_y = _conv64(x64, w64, b64, stride, 1)
    want_dx, want_dw, want_db = np.empty_like(x64), np.zeros_like(w64), np.zeros_like(b64)
    im2col.backward(want_dx, want_dw, want_db, dy64, x64, w64, stride, 1)
    got = y, dx, layer.weight.grad
    if layer._rounds_itself():
        # The bias gradient is no product: kernels that round what they multiply sum dy as
        # it is.
        want_db = operands[2].sum(axis=(0, 2, 3))
    if algorithm == "winograd" and conv.bf16_kernels():
        # Its bf16 products read the transformed tiles (of the operands as they are)
        # rounded: a reference of its own, from which the one above is a rounding away.
        for g, want, apart in zip(got, winograd_bf16_reference(*operands, b64),
                                  (want_y, want_dx, want_dw)):
            assert _rel(g, want) < 1e-4 and _rel(g, apart) > 1e-3
        want_y, want_dx, want_dw = got
    for name, g, want in zip(("y", "dx", "dw", "db"), got + (layer.bias.grad,),
                             (want_y, want_dx, want_dw, want_db)):
        assert _rel(g, want) < 2e-6, name
    # The unrounded float32 result is a bf16 rounding away: the test sees the difference.
    unrounded = _conv64(operands[0], operands[1], b64, stride, 1)
    assert _rel(y, unrounded) > 1e-4


def _bf16_values(a):
    """float64 `a` rounded to bf16 (through float32, as the kernels hold it)."""
    return _rounded(a.astype(np.float32)).astype(np.float64)


# Winograd F(2x2, 3x3): input, weight and output transforms (pyx/winograd.pyx).
WINO_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
WINO_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float64)
WINO_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)


def winograd_bf16_reference(x, w, dy, b):
    """(y, dx, dw) of a 3x3, stride-1, padding-1 convolution by Winograd F(2x2, 3x3) in
    float64 with the GEMM operands rounded to bf16 as the bf16 kernels read them: the
    transformed weights U, input tiles V and output-gradient tiles dM. Even H and W."""
    n, c, h, wd = x.shape
    th, tw = h // 2, wd // 2
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    tiles = np.stack([np.stack([xp[:, :, 2 * i:2 * i + 4, 2 * j:2 * j + 4] for j in range(tw)],
                               2) for i in range(th)], 2)          # (n, c, th, tw, 4, 4)
    v = _bf16_values(WINO_BT @ tiles @ WINO_BT.T)
    u = _bf16_values(WINO_G @ w @ WINO_G.T)                          # (co, c, 4, 4)
    m = np.einsum("ocab,ncijab->noijab", u, v)
    y = (WINO_AT @ m @ WINO_AT.T).transpose(0, 1, 2, 4, 3, 5).reshape(n, -1, h, wd)
    dm = _bf16_values(WINO_AT.T @ dy.reshape(n, -1, th, 2, tw, 2).transpose(0, 1, 2, 4, 3, 5)
                      @ WINO_AT)
    dv = WINO_BT.T @ np.einsum("ocab,noijab->ncijab", u, dm) @ WINO_BT
    dxp = np.zeros_like(xp)
    for i in range(th):
        for j in range(tw):
            dxp[:, :, 2 * i:2 * i + 4, 2 * j:2 * j + 4] += dv[:, :, i, j]
    dw = WINO_G.T @ np.einsum("noijab,ncijab->ocab", dm, v) @ WINO_G
    return y + b[:, None, None], dxp[:, :, 1:-1, 1:-1], dw


@pytest.mark.parametrize("algorithm", ["gemm", "tapgemm"])
@pytest.mark.parametrize("c_in, c_out, kernel, stride, size", [
    (5, 13, 3, 1, 9),        # odd depth (45), partial row panel and column strip
    (1, 6, 5, 1, 12),        # LeNet's conv1: panels of w (25 deep) padded past float32's
    (24, 32, 3, 2, 11),
    (128, 16, 3, 1, 8),      # 1,152 deep: two passes over c
    (17, 40, 1, 1, 7),       # 1x1: the image itself is the operand
    (700, 40, 3, 1, 2)])     # per tap 700 deep: two passes; 2x2 plane
def test_bf16_kernels_round_what_they_read(algorithm, c_in, c_out, kernel, stride, size,
                                           conv_bf16_kernel, rng):
    """The bf16 products given unrounded operands equal float64 on the rounded ones: the
    kernels round as they pack (the float32 result is a bf16 rounding away)."""
    algo = conv_algorithms.ALGORITHMS[algorithm]
    x = rng.standard_normal((3, c_in, size, size)).astype(np.float32)
    w = rng.standard_normal((c_out, c_in, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    pad = kernel // 2
    y = np.empty(conv.output_shape(x.shape, w.shape, stride, pad), np.float32)
    algo.forward(y, x, w, b, stride, pad, bf16=True)
    x64, w64 = (_rounded(a).astype(np.float64) for a in (x, w))
    assert _rel(y, _conv64(x64, w64, b.astype(np.float64), stride, pad)) < 2e-6
    assert _rel(y, _conv64(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                           stride, pad)) > 1e-4
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = np.empty_like(x), np.zeros_like(w)
    algo.backward(dx, dw, None, dy, x, w, stride, pad, bf16=True)
    want_dx, want_dw = np.empty_like(x64), np.zeros_like(w64)
    im2col.backward(want_dx, want_dw, None, _rounded(dy).astype(np.float64), x64, w64, stride,
                    pad)
    assert _rel(dx, want_dx) < 2e-6 and _rel(dw, want_dw) < 2e-6


def test_bf16_kernels_round_by_the_rule(conv_bf16_kernel, rng):
    """Values of every finite class (ties, near ties, subnormals), each the only nonzero
    product of its sum (a 1x1 convolution by the identity): y is each value rounded, bit for
    bit as include/bf16.h's rule (reference_bf16_bits)."""
    values = special_values(rng)
    values = values[np.isfinite(values) & (np.abs(values) < 1e30)][:40 * 96]
    x = values.reshape(1, 40, 96, 1)
    w = np.eye(40, dtype=np.float32).reshape(40, 40, 1, 1)
    y = np.empty_like(x)
    im2col.forward(y, x, w, None, 1, 0, bf16=True)
    want = (reference_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(y, want)


# Which instructions each kernel of kernels/bf16.matmul needs.
GEMM_KERNEL_NEEDS = {"amx_bf16": "x86 AMX-BF16 (tile state granted by Linux) and AVX512_BF16",
                     "bfmmla": "aarch64 FEAT_BF16 (BFMMLA)",
                     "avx512_bf16": "x86 AVX512_BF16 and AVX512BW", "portable": None}


def runnable_gemm_kernel(name):
    """`name`, or a skip saying which instructions this CPU lacks for it."""
    if name not in bf16.gemm_kernels():
        pytest.skip(f"the {name} bf16 GEMM needs {GEMM_KERNEL_NEEDS[name]}, which this CPU "
                    f"({platform.machine()}) does not have")
    return name


def test_every_gemm_kernel_is_listed_with_what_it_needs():
    assert set(GEMM_KERNEL_NEEDS) == set(bf16.GEMM_KERNELS)
    assert bf16.gemm_kernels()[-1] == "portable"
    assert ("bfmmla" in bf16.gemm_kernels()) == ("aarch64_bf16" in bf16.cpu_features())
    assert ("avx512_bf16" in bf16.gemm_kernels()) == ("avx512_bf16" in bf16.cpu_features())


MATMUL_SHAPES = [  # (m, k, n, trans_a, trans_b): whole and partial panels and quads
    (8, 4, 8, False, False), (13, 37, 21, False, False), (64, 300, 37, True, False),
    (17, 9, 33, False, True), (3, 1, 5, True, True), (40, 1100, 19, False, False),
    (9, 2048, 130, False, True)]


@pytest.mark.parametrize("kernel", list(GEMM_KERNEL_NEEDS))
@pytest.mark.parametrize("m, k, n, trans_a, trans_b", MATMUL_SHAPES)
def test_bf16_matmul_matches_float64_on_rounded_operands(kernel, m, k, n, trans_a, trans_b,
                                                         rng):
    runnable_gemm_kernel(kernel)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    a64, b64 = (_rounded(v).astype(np.float64) for v in (a, b))
    want = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    # float32 sums of k exact products: within k ulps of the sum of magnitudes.
    bound = k * np.finfo(np.float32).eps * (np.abs(a64.T if trans_a else a64)
                                            @ np.abs(b64.T if trans_b else b64))
    c = np.full((m, n), np.nan, np.float32)
    bf16.matmul(c, a, b, trans_a, trans_b, kernel=kernel)
    assert np.all(np.abs(c - want) <= bound)
    before = c.copy()
    bf16.matmul(c, a, b, trans_a, trans_b, accumulate=True, kernel=kernel)
    assert np.all(np.abs(c - (before + want)) <= bound + np.abs(before) * 1e-7)
    # The unrounded product is further off than that: the kernel did round.
    exact = ((a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b))
    assert np.abs(c - before - exact).max() > bound.max()


def test_bf16_matmul_kernels_agree_and_ignore_the_thread_count(rng):
    a = rng.standard_normal((70, 531)).astype(np.float32)
    b = rng.standard_normal((531, 250)).astype(np.float32)
    results = {}
    for kernel in bf16.gemm_kernels():
        by_threads = []
        for threads in (1, 2, 3):
            before = kernels.get_num_threads()
            kernels.set_num_threads(threads)
            try:
                by_threads.append(bf16.matmul(np.empty((70, 250), np.float32), a, b,
                                              kernel=kernel))
            finally:
                kernels.set_num_threads(before)
        assert all(np.array_equal(r, by_threads[0]) for r in by_threads), kernel
        results[kernel] = by_threads[0]
    # The kernels differ in summation order only.
    for got in results.values():
        np.testing.assert_allclose(got, results["portable"], rtol=0, atol=2e-4)


def test_bf16_matmul_packs_into_a_workspace_kept_between_calls(rng):
    import tracemalloc
    a = rng.standard_normal((64, 700)).astype(np.float32)
    b = rng.standard_normal((700, 300)).astype(np.float32)
    c = np.empty((64, 300), np.float32)
    bf16.matmul(c, a, b)
    tracemalloc.start()
    try:
        # The same sizes again: nothing new (fresh packed operands would be 2 x 135 KB).
        start = tracemalloc.get_traced_memory()[0]
        bf16.matmul(c, a, b)
        assert tracemalloc.get_traced_memory()[1] - start < 4096
    finally:
        tracemalloc.stop()


def test_bf16_matmul_refuses_bad_arguments_naming_them():
    a, b = np.ones((4, 6), np.float32), np.ones((6, 5), np.float32)
    with pytest.raises(ValueError, match="b: op.a. is .4, 6., so op.b. needs 6 rows"):
        bf16.matmul(np.empty((4, 5), np.float32), a, b, trans_b=True)
    with pytest.raises(ValueError, match="c: expected shape"):
        bf16.matmul(np.empty((5, 4), np.float32), a, b)
    with pytest.raises(TypeError, match="a: expected dtype float32"):
        bf16.matmul(np.empty((4, 5), np.float32), a.astype(np.float64), b)
    with pytest.raises(ValueError, match="c must not overlap a"):
        square = np.ones((6, 6), np.float32)
        bf16.matmul(square, square, square)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        bf16.matmul(np.empty((4, 5), np.float32), a, b, kernel="amx")


@pytest.mark.parametrize("kernel", [None] + list(GEMM_KERNEL_NEEDS))
def test_bf16_linear_computes_on_rounded_operands_in_float32(kernel, rng, monkeypatch):
    # None: float32 BLAS on rounded operands; a name: the layer on kernels/bf16.matmul.
    monkeypatch.setattr(precision, "gemm_kernel",
                        lambda: kernel and runnable_gemm_kernel(kernel))
    layer = nn.Linear(300, 70, generator=rng)
    x = rng.standard_normal((9, 300)).astype(np.float32)
    y, dx, x64, w64, dy64 = _bf16_step(layer, x, rng)
    assert _rel(y, x64 @ w64.T + layer.bias.data) < 2e-6
    assert _rel(dx, dy64 @ w64) < 2e-6
    assert _rel(layer.weight.grad, dy64.T @ x64) < 2e-6
    assert _rel(layer.bias.grad, dy64.sum(0)) < 2e-6
    # Whichever kernel ran the products, the bias gradient is the float32 path's sum.
    db = np.empty(70, np.float32)
    kernels.linear.linear_backward(None, np.empty((70, 300), np.float32), db,
                                   dy64.astype(np.float32), x, layer.weight.data,
                                   accumulate=False)
    np.testing.assert_array_equal(layer.bias.grad, db)
    assert _rel(y, x.astype(np.float64) @ layer.weight.data.T.astype(np.float64)
                + layer.bias.data) > 1e-4


def test_set_precision_reaches_every_gemm_layer_and_relu_and_nothing_else():
    model = precision.set_precision(models.get("resnet18", variant="cifar"), "bf16")
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.ReLU))]
    assert len(layers) == 21 + 17 and all(m.precision == "bf16" for m in layers)
    assert not any(hasattr(m, "precision") for m in model.modules()
                   if not isinstance(m, (precision.Bf16Operands, nn.ReLU)))
    with pytest.raises(ValueError, match="precision: expected one of"):
        precision.set_precision(model, "half")


def _bf16_twins(name, arenas, rng, algorithm="auto", relu_copies=True, steps=3,
                in_precision="bf16"):
    """Models `name` (CIFAR) in `in_precision`, one on each of `arenas` (None: its own
    buffers), trained alike for `steps` SGD steps, each convolution on `algorithm` where
    that runs it; with the ReLUs that kept a bf16 copy of their output in the last
    forward, per model."""
    from dynar import optim

    twins = []
    for arena in arenas:
        model = precision.set_precision(
            models.get(name, variant="cifar", num_classes=10, seed=3), in_precision)
        for layer in model.modules():
            if isinstance(layer, nn.Conv2d) and algorithm != "auto" and \
                    conv_algorithms.ALGORITHMS[algorithm].supports(
                        layer.weight.shape, layer.stride, layer.padding):
                layer.algorithm = algorithm
            if isinstance(layer, nn.ReLU) and not relu_copies:
                layer.precision = "fp32"
        model.step_arena = arena
        twins.append((model, optim.SGD(model, lr=0.05, momentum=0.9), nn.CrossEntropyLoss()))
    copied = [[] for _ in twins]
    for step in range(steps):
        x = rng.standard_normal((4, 3, 32, 32), dtype=np.float32)
        y = rng.integers(0, 10, 4)
        for (model, opt, crit), kept in zip(twins, copied):
            model.zero_grad()
            crit.forward(model.forward(x), y)
            kept[:] = [m for m in model.modules() if isinstance(m, nn.ReLU)
                       and m._y16 is not None]
            model.backward(crit.backward())
            opt.step()
    return [model for model, _, _ in twins], copied


@pytest.mark.parametrize("name", ["vgg11_bn", "resnet18"])
def test_bf16_model_on_the_step_arena_trains_as_with_its_own_buffers(name, rng):
    # The rounded operands are scratch taken from and given back to the arena, and on it
    # every ReLU keeps a bf16 copy of its output, whose float32 memory goes back once the
    # next layer's forward is done; poisoned, an array read after it went back holds NaN.
    # im2col rounds the input it reads, so a convolution backward from the widened copy
    # computes the same bytes (Winograd: the next test).
    from dynar.nn.arena import StepArena
    (arena, own), copied = _bf16_twins(name, [StepArena(min_bytes=0, poison=True), None],
                                       rng, algorithm="gemm")
    relus = [m for m in arena.modules() if isinstance(m, nn.ReLU)]
    assert copied[0] == relus and copied[1] == []
    assert np.all(np.isfinite(arena.flat_params))
    np.testing.assert_array_equal(arena.flat_params, own.flat_params)


@pytest.mark.parametrize("name", ["vgg11_bn", "resnet18"])
def test_bf16_relu_copies_halve_what_a_step_keeps_of_those_outputs(name, rng):
    # On Winograd where it runs (3x3, stride 1), whose backward transforms the
    # widened copy, an input rounded once more than forward's (which transforms, then
    # rounds), so training departs from the run without copies by a bf16 rounding: held
    # to less than bf16's own distance from float32 over the same steps.
    from dynar.nn.arena import StepArena
    arenas = [StepArena(min_bytes=0, poison=True), StepArena(min_bytes=0)]
    (poisoned, copies), _ = _bf16_twins(name, arenas, np.random.default_rng(5),
                                        algorithm="winograd")
    without = StepArena(min_bytes=0)
    (plain,), copied = _bf16_twins(name, [without], np.random.default_rng(5),
                                   algorithm="winograd", relu_copies=False)
    (fp32,), _ = _bf16_twins(name, [StepArena(min_bytes=0)], np.random.default_rng(5),
                             algorithm="winograd", in_precision="fp32")
    assert copied == [[]]
    np.testing.assert_array_equal(poisoned.flat_params, copies.flat_params)
    assert 0 < _rel_norm(copies.flat_params, plain.flat_params) \
        < _rel_norm(plain.flat_params, fp32.flat_params)
    assert arenas[1].nbytes < 0.9 * without.nbytes


def _bf16_net_on_arena_and_off(layers, x, dy):
    """nn.Sequential(*layers(generator)) in bf16 (convolutions on im2col), forward and
    backward once on a poisoned step arena and once on its own buffers: asserts the same
    output and d(input) (a float32 array read after it went back holds NaN), and returns
    the arena's net with the ReLUs that kept a bf16 copy of their output there."""
    from dynar.nn.arena import StepArena
    arena = StepArena(min_bytes=0, poison=True)
    results = []
    for on in (arena, None):
        net = nn.Sequential(*layers(np.random.default_rng(0)))
        for layer in net.modules():
            if isinstance(layer, nn.Conv2d):
                layer.algorithm = "gemm"
        precision.set_precision(net, "bf16").use_arena(on)
        if on is not None:
            arena.begin("train")
        y = net.forward(x).copy()
        copied = [m for m in net.modules() if isinstance(m, nn.ReLU) and m._y16 is not None]
        results.append((net, copied, y, net.backward(dy).copy()))
    (net, copied, y, dx), (_, copied_off, y_off, dx_off) = results
    assert copied_off == []
    np.testing.assert_array_equal(y, y_off)
    np.testing.assert_array_equal(dx, dx_off)
    return net, copied


def test_a_relu_keeps_a_bf16_copy_only_where_the_next_layer_can_do_with_one(rng):
    def layers(g):
        return (nn.Conv2d(3, 8, 3, padding=1, generator=g), nn.ReLU(inplace=True),  # conv next
                nn.Conv2d(8, 8, 3, padding=1, generator=g), nn.ReLU(inplace=True),  # pool next
                nn.MaxPool2d(2), nn.ReLU(),                     # in-place dropout next: no
                nn.Dropout(0.5, inplace=True, generator=g), nn.ReLU(),  # dropout next
                nn.Dropout(0.5, generator=g), nn.ReLU(inplace=True),    # flatten next: no
                nn.Flatten(), nn.Linear(128, 10, generator=g))

    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    net, copied = _bf16_net_on_arena_and_off(layers, x, rng.standard_normal((2, 10),
                                                                            dtype=np.float32))
    assert copied == [net[1], net[3], net[7]]
    net._arena.begin("eval")
    net.eval().forward(x)
    assert not any(isinstance(m, nn.ReLU) and m._y16 is not None for m in net)


def test_a_relu_output_passed_through_a_layer_is_kept_as_the_reader_after_needs(rng):
    # An inactive dropout or an identity pool hands the ReLU's output on: the layer after
    # decides. Here an in-place dropout changes it (a copy made before would be stale), and
    # a Flatten hands a view of it to a Linear, which keeps that view in float32.
    def layers(g):
        return (nn.Conv2d(3, 4, 3, padding=1, generator=g), nn.ReLU(inplace=True),
                nn.Dropout(0.0, generator=g), nn.Dropout(0.5, inplace=True, generator=g),
                nn.Conv2d(4, 4, 3, padding=1, generator=g), nn.ReLU(inplace=True),
                nn.Sequential(nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(),
                              nn.Linear(64, 10, generator=g)))

    _, copied = _bf16_net_on_arena_and_off(
        layers, rng.standard_normal((2, 3, 4, 4), dtype=np.float32),
        rng.standard_normal((2, 10), dtype=np.float32))
    assert copied == []


def _rel_norm(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.torch
@pytest.mark.parametrize("name, variant, relu_copies", [("lenet", "mnist", False),
                                                        ("resnet18", "cifar", False),
                                                        ("resnet18", "cifar", True)])
def test_bf16_model_agrees_with_pytorch_autocast(name, variant, relu_copies, rng):
    # PyTorch's bf16 autocast rounds every activation to bf16 between layers, dynar only the
    # GEMM layers' operands (and, on the step arena, keeps the ReLUs' outputs as bf16 for
    # backward): the two agree to bf16's precision, not bit for bit. Held to the distance
    # between autocast and float32 PyTorch on the same step, so the bound scales with what
    # bf16 itself costs here.
    from dynar.nn.arena import StepArena
    torch = require_torch()
    import torch_reference
    model = precision.set_precision(models.get(name, variant=variant, seed=1), "bf16")
    # 8 images are a small pass: the arena (and with it the copies) is forced on or off.
    model.step_arena = StepArena(min_bytes=0) if relu_copies else None
    twin = torch_reference.build(name, variant)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    x = rng.standard_normal((8,) + model.input_shape, dtype=np.float32)
    labels = rng.integers(0, 10, 8)
    crit = nn.CrossEntropyLoss()
    model.zero_grad()
    logits = model.forward(x).copy()
    assert relu_copies == any(m._y16 is not None for m in model.modules()
                              if isinstance(m, nn.ReLU))
    crit.forward(logits, labels)
    model.backward(crit.backward())

    def torch_step(autocast):
        twin.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = twin(torch.from_numpy(x))
        torch.nn.functional.cross_entropy(out.float(), torch.from_numpy(labels)).backward()
        return (out.float().detach().numpy(),
                {k: p.grad.numpy().copy() for k, p in twin.named_parameters()})

    want_logits, want_grads = torch_step(True)
    fp32_logits, fp32_grads = torch_step(False)
    bf16_gap = _rel_norm(want_logits, fp32_logits)
    assert _rel_norm(logits, want_logits) < max(2 * bf16_gap, 1e-2)
    grads = dict(model.named_parameters())
    for k, want in want_grads.items():
        if k.endswith("bias") and np.linalg.norm(want) < 1e-6:
            continue
        gap = _rel_norm(want, fp32_grads[k])
        assert _rel_norm(grads[k].grad, want) < max(2 * gap, 3e-2), k


def _round_like_dynar(torch, twin):
    """`twin` (a float64 torch_reference model) with each convolution and fully connected
    layer computing as dynar's bf16 path: input and weight rounded to bf16 going forward,
    the output's gradient rounded coming back; everything else float64."""
    def rounded(t):
        return t.to(torch.float32).to(torch.bfloat16).to(t.dtype)

    class Operand(torch.autograd.Function):
        forward = staticmethod(lambda ctx, t: rounded(t))
        backward = staticmethod(lambda ctx, g: g)

    class Output(torch.autograd.Function):
        forward = staticmethod(lambda ctx, t: t.clone())
        backward = staticmethod(lambda ctx, g: rounded(g))

    functional = torch.nn.functional
    for m in twin.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.forward = (lambda m: lambda x: Output.apply(functional.conv2d(
                Operand.apply(x), Operand.apply(m.weight), m.bias, m.stride, m.padding)))(m)
        elif isinstance(m, torch.nn.Linear):
            m.forward = (lambda m: lambda x: Output.apply(functional.linear(
                Operand.apply(x), Operand.apply(m.weight), m.bias)))(m)
    return twin


@pytest.mark.torch
def test_bf16_lenet_matches_float64_with_the_same_roundings(rng):
    # Against float64 rounding the same operands, dynar's bf16 step is off by float32 sums
    # and the odd operand rounded the other way from a near-tie; its float32 step is off by
    # bf16 itself, orders of magnitude more. Only a shallow model keeps that apart: each
    # rounding turns a small difference d between the two into about sqrt(d * 2^-8), so
    # after a dozen roundings (AlexNet's forward and backward) the two agree to bf16's
    # precision only, which the autocast test below holds whole models to.
    name, variant = "lenet", "mnist"
    torch = require_torch()
    import torch_reference
    x = rng.standard_normal((8,) + models.get(name, variant=variant).input_shape,
                            dtype=np.float32)
    labels = rng.integers(0, 10, 8)
    errors = {}
    for mode in precision.PRECISIONS:
        model = precision.set_precision(models.get(name, variant=variant, seed=1), mode)
        twin = _round_like_dynar(torch, torch_reference.build(name, variant).double())
        twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
        crit = nn.CrossEntropyLoss()
        logits = model.forward(x).copy()
        crit.forward(logits, labels)
        model.zero_grad()
        model.backward(crit.backward())
        out = twin(torch.from_numpy(x).double())
        torch.nn.functional.cross_entropy(out, torch.from_numpy(labels)).backward()
        grads = dict(model.named_parameters())
        errors[mode] = [_rel_norm(logits, out.detach().numpy())] + [
            _rel_norm(grads[k].grad, p.grad.numpy()) for k, p in twin.named_parameters()]
    bf16_errors, fp32_errors = np.array(errors["bf16"]), np.array(errors["fp32"])
    assert bf16_errors[0] < 1e-3 and np.median(bf16_errors) < 1e-4, bf16_errors
    assert np.median(fp32_errors) > 100 * np.median(bf16_errors), (fp32_errors, bf16_errors)


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "dynar.train", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.slow      # 4 s on x86; 20 epochs under qemu pass 300 s (docs/ARM.md)
def test_bf16_trains_lenet_on_the_mnist_sample_to_96_percent(tmp_path):
    log = tmp_path / "log.jsonl"
    out = cli("--precision", "bf16", "--log", str(log), env={precision.ANY_CPU_VARIABLE: "1"})
    assert out.returncode == 0, out.stderr
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["precision"] == "bf16" and summary["final_accuracy"] >= 0.96, summary
    assert "precision bf16" in out.stdout


@pytest.mark.skipif(bool(bf16.cpu_features()), reason="this CPU has bf16 instructions")
def test_bf16_on_a_cpu_without_it_says_so_and_runs_fp32(tmp_path):
    log = tmp_path / "log.jsonl"
    out = cli("--precision", "bf16", "--max-steps", "2", "--eval-every", "0", "--log", str(log),
              env={precision.ANY_CPU_VARIABLE: "0"})
    assert out.returncode == 0, out.stderr
    assert "this CPU has no bf16 instructions" in out.stdout and "running fp32" in out.stdout
    assert json.loads(log.read_text().splitlines()[-1])["precision"] == "fp32"


SHORT = dict(max_steps=2, eval_every=0, batch_size=16)


def test_resume_in_the_other_precision_needs_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv(precision.ANY_CPU_VARIABLE, "1")
    train(TrainConfig(checkpoint_dir=str(tmp_path), precision="bf16", **SHORT))
    assert checkpoint.load(tmp_path / "last.ckpt")["config"]["precision"] == "bf16"
    with pytest.raises(checkpoint.CheckpointError,
                       match="saved with --precision 'bf16', this run has 'fp32'.*"
                             "--allow-precision-change"):
        train(TrainConfig(resume=str(tmp_path), **dict(SHORT, max_steps=3)))
    done = train(TrainConfig(resume=str(tmp_path), allow_precision_change=True,
                             **dict(SHORT, max_steps=3)))
    assert done.summary["steps"] == 3 and done.summary["precision"] == "fp32"


def test_evaluating_a_bf16_run_asks_for_its_precision(tmp_path, monkeypatch):
    # Evaluating computes as the run did: in another precision only when asked to.
    monkeypatch.setenv(precision.ANY_CPU_VARIABLE, "1")
    train(TrainConfig(checkpoint_dir=str(tmp_path), precision="bf16", **SHORT))
    evaluate = dict(SHORT, resume=str(tmp_path), eval_only=True)
    with pytest.raises(checkpoint.CheckpointError,
                       match="saved with --precision 'bf16', this run has 'fp32' \\(evaluating"
                             ".*bf16 instructions, or with DYNAR_BF16_ANY_CPU=1\\) or pass "
                             "--allow-precision-change"):
        train(TrainConfig(**evaluate))
    assert train(TrainConfig(precision="bf16", **evaluate)).summary["precision"] == "bf16"
    assert train(TrainConfig(allow_precision_change=True, **evaluate)
                 ).summary["precision"] == "fp32"
