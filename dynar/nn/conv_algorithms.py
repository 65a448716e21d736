"""Which convolution algorithm nn.Conv2d runs a layer on: the four algorithms by name, and
every threshold "auto" picks one by.

Each threshold names the measurement behind it: layers of `python -m perf kernels`
(perf/results/kernels.json: batch 64, forward + backward GF/s, 2 threads of an AMD EPYC Zen 4
built for AVX-512), or, for shapes that suite does not run, the note that has them.
"""
from ..kernels import direct, im2col, tapgemm, winograd

# Conv2d.algorithm -> the conv.Algorithm that computes it (forward, backward, supports).
ALGORITHMS = {
    "gemm": im2col.algorithm,
    "winograd": winograd.algorithm,
    "direct": direct.algorithm,
    "tapgemm": tapgemm.algorithm,
}

# The direct kernels up to this many channel pairs C_in * C_out, a bound by the build's vector
# width (include/direct_taps.h).
# perf/results/kernels.json: lenet conv1, conv2 and the 3-channel first layers of VGG, ResNet.
DIRECT_MAX_CHANNEL_PAIRS = direct.PREFERRED_MAX_PAIRS
# ... but not 3x3 layers with fewer output pixels, where Winograd's lane kernels win.
# docs/notes/2026-12-02-kernels.md, "Where each algorithm wins": 16 -> 16 and 32 -> 32 at 8x8.
DIRECT_MIN_PIXELS_3X3 = 256

# The per-tap GEMMs on outputs of this many pixels or fewer, at any channel count.
# perf/results/kernels.json: vgg16-cifar 512->512@2.
TAPGEMM_MAX_PIXELS_ANY_CHANNELS = 4
# ... and on outputs up to this many pixels with TAPGEMM_MIN_CHANNELS channels in and out.
# perf/results/kernels.json: alexnet-cifar features.6/8/10, vgg16 @4, resnet18 layer4.
TAPGEMM_MAX_PIXELS = 16
# docs/notes/2026-12-02-kernels.md, "Where each algorithm wins": 128 -> 128 at 4x4 ties Winograd.
TAPGEMM_MIN_CHANNELS = 192

# Winograd on 3x3 stride-1 layers with this many input channels or more.
# perf/results/kernels.json: the 3-channel first layers (vgg16-cifar 3->64@32, resnet18 conv1).
WINOGRAD_MIN_CHANNELS = 16
# ... and outputs of this many pixels or more.
# docs/notes/2026-12-02-kernels.md, "Where each algorithm wins": 2x2 outputs, 0.7x im2col.
WINOGRAD_MIN_PIXELS = 16


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def preferred(x_shape, w_shape, stride, padding):
    """The name of the algorithm "auto" runs a layer on: the direct kernels for few channel
    pairs, else the per-tap GEMMs on the smallest outputs, else Winograd for 3x3 stride-1
    layers, else im2col/GEMM ("gemm")."""
    C, H, W = x_shape[1:]
    Co, _, kh, kw = w_shape
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    pixels = ((H + 2 * ph - kh) // sh + 1) * ((W + 2 * pw - kw) // sw + 1)
    is_3x3 = kh == 3 and kw == 3
    if (direct.supports(w_shape, stride, padding) and C * Co <= DIRECT_MAX_CHANNEL_PAIRS
            and not (is_3x3 and pixels < DIRECT_MIN_PIXELS_3X3)):
        return "direct"
    if kh * kw > 1 and (pixels <= TAPGEMM_MAX_PIXELS_ANY_CHANNELS or (
            pixels <= TAPGEMM_MAX_PIXELS and min(C, Co) >= TAPGEMM_MIN_CHANNELS)):
        return "tapgemm"   # (one tap has nothing to skip)
    if (winograd.supports(w_shape, stride, padding) and C >= WINOGRAD_MIN_CHANNELS
            and pixels >= WINOGRAD_MIN_PIXELS):
        return "winograd"
    return "gemm"
