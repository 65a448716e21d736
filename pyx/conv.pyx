"""The one interface of the four 2-D convolution algorithms, and what they share.

Every algorithm module (dynar.kernels.im2col, winograd, direct, tapgemm) has the same
entry points, those of its `algorithm`, an Algorithm:

    forward(y, x, w, b=None, stride=1, padding=0)
    backward(dx, dw, db, dy, x, w, stride=1, padding=0)
    supports(w_shape, stride=1, padding=0)

over NCHW arrays and OIHW weights, all float32 or all float64. They share this module's
workspace (one buffer for the four, reused call after call) and its choice of GEMM for the
products with the weights (set_panel_gemm), blocked for this machine's L1 data cache
(panel_block_bytes).
"""
import os

cimport numpy as cnp

from _conv_call cimport (ConvAlgorithm, ConvCall, ConvGeometry, PlanSpace, backward_call,
                         capsule_algorithm, conv_geometry, forward_call,
                         output_shape as geometry_output_shape)
from _panels cimport PANEL_GEMM_PREFERRED, bf16_panel_kernels
from _scratch cimport Scratch, scratch_give, scratch_release, scratch_take
from _validate cimport F32, check_pair

cnp.import_array()

cdef Scratch _workspace
cdef bint _panel_gemm = PANEL_GEMM_PREFERRED

cdef extern from "bf16.h" nogil:
    enum:
        DYNAR_BF16_AVX512
        DYNAR_BF16_AMX
        DYNAR_BF16_ARM

# The bf16 kernels of the panel GEMM by name, fastest first, and those this CPU runs; then
# "portable", which every CPU runs: float32 kernels on operands the layer rounds.
BF16_KERNELS = {"amx_bf16": DYNAR_BF16_AMX, "avx512_bf16": DYNAR_BF16_AVX512,
                "bfmmla": DYNAR_BF16_ARM, "portable": 0}
cdef int _bf16_runs = bf16_panel_kernels()
cdef int _bf16_kernel = next((kernel for kernel in BF16_KERNELS.values() if _bf16_runs & kernel),
                             0)


def _sysfs_cache(index, name):
    with open(os.path.join("/sys/devices/system/cpu/cpu0/cache", index, name)) as f:
        return f.read().strip()


def l1_data_cache_bytes():
    """One core's L1 data cache as the OS reports it (sysfs, else sysconf); None when it
    does not."""
    try:
        for index in sorted(os.listdir("/sys/devices/system/cpu/cpu0/cache")):
            if (_sysfs_cache(index, "level") == "1"
                    and _sysfs_cache(index, "type") in ("Data", "Unified")):
                size = _sysfs_cache(index, "size")           # e.g. "32K"
                scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
                return int(size.rstrip("KkMm")) * scale
    except (OSError, ValueError):
        pass
    try:
        size = os.sysconf("SC_LEVEL1_DCACHE_SIZE")
        return size if size > 0 else None
    except (ValueError, OSError):
        return None


# A panel's part of one pass of the panel GEMM fills half the L1 data cache; where the OS does
# not say, the 48 KB of the machine the blocking was measured on (include/panel_gemm.h).
cdef Py_ssize_t _panel_block = (l1_data_cache_bytes() or 48 << 10) // 2


def panel_block_bytes(Py_ssize_t nbytes=0):
    """The bytes of L1 a panel's part of one pass of the panel GEMM fills (half this
    machine's L1 data cache); nbytes > 0 sets it. Results do not depend on it: each sum runs
    in the same order whatever the passes. Returns the value before."""
    global _panel_block
    previous = _panel_block
    if nbytes > 0:
        _panel_block = nbytes
    return previous


def output_shape(x_shape, w_shape, stride=1, padding=0):
    """(N, C_out, H_out, W_out) of forward, or ValueError naming what is wrong.

    x_shape: (N, C_in, H, W); w_shape: (C_out, C_in, kh, kw)."""
    cdef ConvGeometry g = conv_geometry(x_shape, w_shape, stride, padding)
    return geometry_output_shape(&g)


def workspace_bytes():
    """Bytes of the shared workspace held between calls."""
    return _workspace.size


def release_workspace():
    """Free the shared workspace; the next call grows it to what that call needs. Timing
    the candidates of a layer grows it to the largest candidate's need, which the chosen
    algorithms may never have: releasing it then keeps that out of the run's memory."""
    scratch_release(&_workspace, "convolution")


def bf16_kernels():
    """Whether bf16 calls (forward's and backward's bf16=True) run on bf16 instructions
    here: AMX, AVX512_BF16 or aarch64's BFMMLA (bf16_kernel), on bf16 panels whatever
    set_panel_gemm says for float32. Elsewhere they compute in float32."""
    return _bf16_kernel != 0


def bf16_kernel(name=None):
    """The bf16 kernel bf16 calls run on: "amx_bf16", "avx512_bf16", "bfmmla" (the fastest
    this CPU runs, by default), or "portable" where it runs none. A name sets it (ValueError
    naming what this CPU runs when it cannot). Returns the kernel before."""
    global _bf16_kernel
    previous = next(n for n, k in BF16_KERNELS.items() if k == _bf16_kernel)
    if name is not None:
        if name not in BF16_KERNELS or (BF16_KERNELS[name] and
                                        not _bf16_runs & BF16_KERNELS[name]):
            runs = [n for n, k in BF16_KERNELS.items() if not k or _bf16_runs & k]
            raise ValueError(f"bf16 kernel {name!r}: this CPU runs {', '.join(map(repr, runs))}")
        _bf16_kernel = BF16_KERNELS[name]
    return previous


def set_panel_gemm(bint enabled):
    """Whether the float32 products with the weights (im2col's and Winograd's) run on dynar's
    panel GEMM (True) or on BLAS; returns the previous setting. The default is the panel GEMM
    where the build targets AVX2 or AVX-512, where it was measured faster. (bf16 calls on bf16
    instructions always run on bf16 panels; bf16_kernel("portable") sends them here.)"""
    global _panel_gemm
    previous = _panel_gemm
    _panel_gemm = enabled
    return previous


cdef void _run_kernel(const ConvAlgorithm* a, const ConvCall* c, const void* plan,
                      void* work) noexcept nogil:
    if c.backward and c.kind == F32:
        a.backward_f(<float*> c.dx, <float*> c.dw, <float*> c.db, <const float*> c.dy,
                     <const float*> c.x, <const float*> c.w, plan, <float*> work)
    elif c.backward:
        a.backward_d(<double*> c.dx, <double*> c.dw, <double*> c.db, <const double*> c.dy,
                     <const double*> c.x, <const double*> c.w, plan, <double*> work)
    elif c.kind == F32:
        a.forward_f(<float*> c.y, <const float*> c.x, <const float*> c.w,
                    <const float*> c.b, plan, <float*> work)
    else:
        a.forward_d(<double*> c.y, <const double*> c.x, <const double*> c.w,
                    <const double*> c.b, plan, <double*> work)


cdef class Algorithm:
    """A convolution algorithm's entry points; its module makes it from the capsule of its
    ConvAlgorithm (_conv_call.algorithm_capsule)."""
    cdef const ConvAlgorithm* _impl

    def __cinit__(self, capsule):
        self._impl = capsule_algorithm(capsule)
        if self._impl.plan_size > sizeof(PlanSpace):
            raise ValueError(f"{self.name}: a plan of {self._impl.plan_size} bytes does not "
                             f"fit the {sizeof(PlanSpace)} of PlanSpace (pyx/_conv_call.pxd)")

    @property
    def name(self):
        return self._impl.name.decode()

    @property
    def needs(self):
        """The layers it computes (what supports checks), in words."""
        return self._impl.needs.decode()

    def forward(self, y, x, w, b=None, stride=1, padding=0, bf16=False):
        """y (N, C_out, H_out, W_out) = conv2d(x (N, C_in, H, W), w (C_out, C_in, kh, kw))
        + b (C_out,).

        y is overwritten. b may be None. stride, padding: int or (h, w). bf16: every product
        reads its operands rounded to bf16 and sums in float32, where the CPU runs the bf16
        kernels (bf16_kernels()) and the algorithm has them (im2col, Winograd, which rounds
        its transformed tiles, and tapgemm); otherwise the call is float32, and nn.Conv2d
        rounds the operands first."""
        cdef ConvCall c = forward_call(y, x, w, b, stride, padding)
        self._run(&c, bf16)

    def backward(self, dx, dw, db, dy, x, w, stride=1, padding=0, bf16=False):
        """Gradients of forward given dy (N, C_out, H_out, W_out).

        dx (N, C_in, H, W) is overwritten (None skips the input gradient, as for a first
        layer); dw (C_out, C_in, kh, kw) and db (C_out,) are accumulated into (+=); db may be
        None. bf16: as forward's."""
        cdef ConvCall c = backward_call(dx, dw, db, dy, x, w, stride, padding)
        self._run(&c, bf16)

    def supports(self, w_shape, stride=1, padding=0):
        """Whether it computes a layer of weights w_shape (C_out, C_in, kh, kw) at this stride
        and padding (int or (h, w)); forward and backward refuse the others."""
        ws = tuple(w_shape)
        if len(ws) != 4:
            raise ValueError(f"w: expected 4 dimensions (C_out, C_in, kh, kw), got shape {ws}")
        cdef ConvGeometry g
        g.kh, g.kw = ws[2], ws[3]
        g.sh, g.sw = check_pair("stride", stride, 1)
        g.ph, g.pw = check_pair("padding", padding, 0)
        return self._impl.supports == NULL or self._impl.supports(&g)

    cdef _run(self, ConvCall* c, bint bf16):
        if self._impl.supports != NULL and not self._impl.supports(&c.g):
            raise ValueError(f"{self.name}: needs {self.needs}, got a {c.g.kh}x{c.g.kw} "
                             f"kernel at stride {(c.g.sh, c.g.sw)}")
        c.bf16 = _bf16_kernel if bf16 and c.kind == F32 else 0
        # bf16 instructions multiply bf16 panels: the switch is float32's.
        c.panel_block = _panel_block if _panel_gemm or c.bf16 else 0
        cdef PlanSpace plan
        cdef bint private
        cdef size_t work_bytes = self._impl.plan(c, &plan)
        cdef void* work = scratch_take(&_workspace, work_bytes, &private)
        try:
            with nogil:
                _run_kernel(self._impl, c, &plan, work)
        finally:
            scratch_give(&_workspace, work, private)

    def __repr__(self):
        return f"<convolution algorithm {self.name}>"
