"""Convolution kernels against PyTorch and the GEMM ceiling, layer by layer.

For every conv layer shape of LeNet (MNIST) and AlexNet, VGG-16 and ResNet-18 (CIFAR), batch
64: GFLOP/s of dynar's forward and backward (weight + input gradient) next to
torch.nn.functional.conv2d's with the same thread count, and the float32 GEMM ceiling
(numpy `a @ b` at 2048^3) measured in the same run. "dynar" is the algorithm nn.Conv2d picks
(nn.conv_algorithms.preferred); every algorithm that supports the layer is timed too (im2col/GEMM
and the per-tap GEMMs always, the direct kernels at stride 1, Winograd on 3x3 stride 1), which
is the measurement behind that choice. Every GFLOP/s counts the direct convolution's
multiply-adds, padding included: Winograd does fewer and the per-tap GEMMs skip the padding,
so both can exceed the ceiling. Where dynar runs im2col or Winograd, the same kernel is also
timed with its products with the weights on dynar's panel GEMM and on BLAS, each forced
(conv.set_panel_gemm): a hand-written kernel is the default only where it beats BLAS
(docs/DESIGN.md, "Benchmark protocol").
"""
import numpy as np

from . import harness

BATCH = 64

# (network, layer, C_in, C_out, kernel, stride, padding, H=W of the input)
LAYERS = [
    ("lenet", "conv1", 1, 6, 5, 1, 2, 28),
    ("lenet", "conv2", 6, 16, 5, 1, 0, 14),
    ("alexnet-cifar", "features.0", 3, 64, 3, 2, 1, 32),
    ("alexnet-cifar", "features.3", 64, 192, 3, 1, 1, 8),
    ("alexnet-cifar", "features.6", 192, 384, 3, 1, 1, 4),
    ("alexnet-cifar", "features.8", 384, 256, 3, 1, 1, 4),
    ("alexnet-cifar", "features.10", 256, 256, 3, 1, 1, 4),
    ("vgg16-cifar", "3->64@32", 3, 64, 3, 1, 1, 32),
    ("vgg16-cifar", "64->64@32", 64, 64, 3, 1, 1, 32),
    ("vgg16-cifar", "64->128@16", 64, 128, 3, 1, 1, 16),
    ("vgg16-cifar", "128->128@16", 128, 128, 3, 1, 1, 16),
    ("vgg16-cifar", "128->256@8", 128, 256, 3, 1, 1, 8),
    ("vgg16-cifar", "256->256@8", 256, 256, 3, 1, 1, 8),
    ("vgg16-cifar", "256->512@4", 256, 512, 3, 1, 1, 4),
    ("vgg16-cifar", "512->512@4", 512, 512, 3, 1, 1, 4),
    ("vgg16-cifar", "512->512@2", 512, 512, 3, 1, 1, 2),
    ("resnet18-cifar", "conv1", 3, 64, 3, 1, 1, 32),
    ("resnet18-cifar", "layer1 3x3", 64, 64, 3, 1, 1, 32),
    ("resnet18-cifar", "layer2.0.conv1 s2", 64, 128, 3, 2, 1, 32),
    ("resnet18-cifar", "layer2 3x3", 128, 128, 3, 1, 1, 16),
    ("resnet18-cifar", "layer2.0.downsample 1x1", 64, 128, 1, 2, 0, 32),
    ("resnet18-cifar", "layer3.0.conv1 s2", 128, 256, 3, 2, 1, 16),
    ("resnet18-cifar", "layer3 3x3", 256, 256, 3, 1, 1, 8),
    ("resnet18-cifar", "layer3.0.downsample 1x1", 128, 256, 1, 2, 0, 16),
    ("resnet18-cifar", "layer4.0.conv1 s2", 256, 512, 3, 2, 1, 8),
    ("resnet18-cifar", "layer4 3x3", 512, 512, 3, 1, 1, 4),
    ("resnet18-cifar", "layer4.0.downsample 1x1", 256, 512, 1, 2, 0, 8),
]


# Table names of nn.Conv2d's kernels.
ALGORITHMS = {"gemm": "im2col", "winograd": "winograd", "direct": "direct",
              "tapgemm": "tapgemm"}


def _weights_on(panels, kernel):
    """kernel() with the products with the weights on the panel GEMM (True) or on BLAS,
    whatever the build's default, which is restored after."""
    from dynar.kernels import conv

    def run():
        before = conv.set_panel_gemm(panels)
        try:
            kernel()
        finally:
            conv.set_panel_gemm(before)
    return run


def _panel_gemm_default():
    from dynar.kernels import conv
    default = conv.set_panel_gemm(True)
    conv.set_panel_gemm(default)
    return default


def _layer_candidates(torch, C, Co, k, s, p, H, rng):
    from dynar.kernels import conv
    from dynar.nn import conv_algorithms

    x = rng.standard_normal((BATCH, C, H, H), dtype=np.float32)
    w = rng.standard_normal((Co, C, k, k), dtype=np.float32) / np.float32(np.sqrt(C * k * k))
    y = np.empty(conv.output_shape(x.shape, w.shape, s, p), np.float32)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx, dw = np.empty_like(x), np.zeros_like(w)
    xt = torch.from_numpy(x).requires_grad_(True)
    wt = torch.from_numpy(w.copy()).requires_grad_(True)
    dyt = torch.from_numpy(dy)
    F = torch.nn.functional

    def torch_backward():
        out = F.conv2d(xt, wt, None, s, p)
        torch.autograd.grad(out, (xt, wt), dyt)

    candidates = {
        "torch_fwd": lambda: F.conv2d(xt, wt, None, s, p),
        # autograd needs the forward graph: time forward+backward, subtract the forward.
        "torch_fwd_bwd": torch_backward,
    }
    for name, kernel in conv_algorithms.ALGORITHMS.items():
        if kernel.supports(w.shape, s, p):
            candidates[f"{ALGORITHMS[name]}_fwd"] = (
                lambda kernel=kernel: kernel.forward(y, x, w, None, s, p))
            candidates[f"{ALGORITHMS[name]}_bwd"] = (
                lambda kernel=kernel: kernel.backward(dx, dw, None, dy, x, w, s, p))
    algorithm = ALGORITHMS[conv_algorithms.preferred(x.shape, w.shape, s, p)]
    if algorithm in ("im2col", "winograd"):
        for pass_ in ("fwd", "bwd"):
            for on, panels in (("panel", True), ("blas", False)):
                candidates[f"{on}_{pass_}"] = _weights_on(panels,
                                                          candidates[f"{algorithm}_{pass_}"])
    flops = 2.0 * BATCH * Co * C * k * k * y.shape[2] * y.shape[3]
    return candidates, flops, algorithm


def summary_text(summary):
    return (f"threads {summary['threads']}; GEMM ceiling (numpy a @ b, 2048^3, float32): "
            f"{summary['gemm_ceiling_gflops']:.0f} GFLOP/s. 3x3 layers with >= 64 channels: "
            f"fwd+bwd at {100 * summary['deep3x3_min_fraction_of_ceiling']:.0f}% (worst) / "
            f"{100 * summary['deep3x3_geomean_fraction_of_ceiling']:.0f}% (geomean) of the "
            f"ceiling. All layers: geometric-mean speed-up vs PyTorch "
            f"{summary['geomean_speedup_vs_torch']:.2f}x. Layers on im2col or Winograd, "
            f"their products with the weights on the panel GEMM against on BLAS (the build's "
            f"default: {'panel GEMM' if summary['panel_gemm_default'] else 'BLAS'}): "
            f"{summary['panel_vs_blas_geomean']:.2f}x (geomean; "
            f"{summary['panel_vs_blas_min']:.2f}x-{summary['panel_vs_blas_max']:.2f}x).")


def run(quick=False):
    import torch
    from dynar import kernels
    threads = kernels.get_num_threads()
    torch.set_num_threads(threads)
    repeats = 3 if quick else 7
    rng = np.random.default_rng(0)
    ceiling, ceiling_samples = harness.gemm_ceiling_gflops(repeats=3 if quick else 5)
    rows, records = [], []
    for net, name, C, Co, k, s, p, H in LAYERS:
        candidates, flops, algorithm = _layer_candidates(torch, C, Co, k, s, p, H, rng)
        samples = harness.alternate(candidates, repeats)
        t = {key: harness.median(v) for key, v in samples.items()}
        fwd, bwd = t[f"{algorithm}_fwd"], t[f"{algorithm}_bwd"]
        torch_total = t["torch_fwd_bwd"]
        rec = dict(network=net, layer=name, C_in=C, C_out=Co, kernel=k, stride=s, padding=p,
                   H=H, batch=BATCH, flops_forward=flops, samples=samples, algorithm=algorithm,
                   dynar_fwd_gflops=flops / fwd / 1e9,
                   dynar_bwd_gflops=2 * flops / bwd / 1e9,
                   dynar_fwd_bwd_gflops=3 * flops / (fwd + bwd) / 1e9,
                   **{f"{a}_fwd_bwd_gflops": (3 * flops / (t[f"{a}_fwd"] + t[f"{a}_bwd"]) / 1e9
                                              if f"{a}_fwd" in t else None)
                      for a in ALGORITHMS.values()},
                   torch_fwd_gflops=flops / t["torch_fwd"] / 1e9,
                   torch_bwd_gflops=2 * flops / max(t["torch_fwd_bwd"] - t["torch_fwd"], 1e-9) / 1e9,
                   torch_fwd_bwd_gflops=3 * flops / torch_total / 1e9,
                   speedup_vs_torch=torch_total / (fwd + bwd))
        rec["fwd_bwd_fraction_of_ceiling"] = rec["dynar_fwd_bwd_gflops"] / ceiling
        for on in ("panel", "blas"):
            rec[f"weights_on_{on}_fwd_bwd_gflops"] = (
                3 * flops / (t[f"{on}_fwd"] + t[f"{on}_bwd"]) / 1e9 if f"{on}_fwd" in t else None)
        records.append(rec)
        per_algorithm = [rec[f"{a}_fwd_bwd_gflops"] for a in ALGORITHMS.values()]
        rows.append([net, name, algorithm, f"{rec['dynar_fwd_gflops']:.0f}",
                     f"{rec['dynar_bwd_gflops']:.0f}",
                     *("-" if g is None else f"{g:.0f}" for g in per_algorithm),
                     *("-" if rec[f"weights_on_{on}_fwd_bwd_gflops"] is None
                       else f"{rec[f'weights_on_{on}_fwd_bwd_gflops']:.0f}"
                       for on in ("panel", "blas")),
                     f"{rec['torch_fwd_gflops']:.0f}", f"{rec['torch_bwd_gflops']:.0f}",
                     f"{100 * rec['fwd_bwd_fraction_of_ceiling']:.0f}%",
                     f"{rec['speedup_vs_torch']:.2f}x"])
    deep = [r for r in records if r["kernel"] == 3 and r["C_in"] >= 64 and r["C_out"] >= 64]
    panel_gains = [r["weights_on_panel_fwd_bwd_gflops"] / r["weights_on_blas_fwd_bwd_gflops"]
                   for r in records if r["weights_on_blas_fwd_bwd_gflops"]]
    summary = {
        "threads": threads,
        "gemm_ceiling_gflops": ceiling,
        "gemm_ceiling_samples": ceiling_samples,
        "geomean_speedup_vs_torch": harness.geometric_mean(r["speedup_vs_torch"] for r in records),
        "deep3x3_min_fraction_of_ceiling": min(r["fwd_bwd_fraction_of_ceiling"] for r in deep),
        "deep3x3_geomean_fraction_of_ceiling": harness.geometric_mean(
            r["fwd_bwd_fraction_of_ceiling"] for r in deep),
        "panel_vs_blas_geomean": harness.geometric_mean(panel_gains),
        "panel_vs_blas_min": min(panel_gains),
        "panel_vs_blas_max": max(panel_gains),
        "panel_gemm_default": bool(_panel_gemm_default()),
    }
    table = harness.format_table(
        ["network", "layer", "dynar runs", "dynar fwd GF/s", "dynar bwd GF/s",
         *(f"{a} fwd+bwd GF/s" for a in ALGORITHMS.values()),
         "w on panel GEMM fwd+bwd GF/s", "w on BLAS fwd+bwd GF/s", "torch fwd GF/s",
         "torch bwd GF/s",
         "dynar fwd+bwd / ceiling", "fwd+bwd speed-up vs torch"], rows)
    table += "\n\n" + summary_text(summary)
    print(table)
    path = harness.write_result("kernels", {"summary": summary, "layers": records, "table": table})
    print(f"wrote {path}")
    return summary
