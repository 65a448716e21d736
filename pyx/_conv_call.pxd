# One call of a convolution algorithm, and what an algorithm gives the common interface.
#
# The four algorithms (pyx/im2col.pyx, winograd.pyx, direct.pyx, tapgemm.pyx) take the same
# arguments and must treat them the same way, so their entry points are one class,
# conv.Algorithm (pyx/conv.pyx): it checks a call (forward_call / backward_call below), asks
# the algorithm to plan it, takes the workspace all four share, and runs the algorithm's
# kernel in float or double. An algorithm module describes itself to it in a ConvAlgorithm.
# Every module that cimports this must call cnp.import_array() at module level.
cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.string cimport memset

from _tap_range cimport check_window_fits, window_positions
from _validate cimport FloatKind, check_disjoint, check_float, check_pair, check_shape, data, \
    float_kind


cdef struct ConvGeometry:
    Py_ssize_t N, C, H, W      # x (N, C_in, H, W)
    Py_ssize_t Co, kh, kw      # w (C_out, C_in, kh, kw)
    Py_ssize_t sh, sw, ph, pw  # stride, padding
    Py_ssize_t Ho, Wo          # y (N, C_out, Ho, Wo)


cdef struct ConvCall:
    FloatKind kind
    bint backward
    # The products with the weights on dynar's panel GEMM, a panel's pass filling at most
    # this many bytes of L1 (conv.panel_block_bytes); 0: on BLAS.
    Py_ssize_t panel_block
    # Those products on bf16 panels (include/panel_gemm_bf16.h), on this kernel (DYNAR_BF16_AMX,
    # DYNAR_BF16_AVX512 or DYNAR_BF16_ARM, conv.bf16_kernel); 0 for float32. Set only for
    # float32 calls asking for bf16 on a CPU that runs the kernel, and panel_block with it.
    int bf16
    ConvGeometry g
    # The arrays' data; NULL for an optional one left out (b, db, dx) or one of the other pass.
    void* y
    void* dx
    void* dw
    void* db
    const void* x
    const void* w
    const void* b
    const void* dy


# Room for any algorithm's plan of a call (conv.Algorithm checks that the algorithm's fits).
cdef struct PlanSpace:
    Py_ssize_t words[64]

ctypedef void (*ForwardFloat)(float* y, const float* x, const float* w, const float* b,
                              const void* plan, float* work) noexcept nogil
ctypedef void (*ForwardDouble)(double* y, const double* x, const double* w, const double* b,
                               const void* plan, double* work) noexcept nogil
ctypedef void (*BackwardFloat)(float* dx, float* dw, float* db, const float* dy,
                               const float* x, const float* w, const void* plan,
                               float* work) noexcept nogil
ctypedef void (*BackwardDouble)(double* dx, double* dw, double* db, const double* dy,
                                const double* x, const double* w, const void* plan,
                                double* work) noexcept nogil


cdef struct ConvAlgorithm:
    const char* name    # as in its error messages
    const char* needs   # the layers it computes, for the message refusing the others
    size_t plan_size    # sizeof its plan
    # Whether it computes a layer of g's kernel, stride and padding (the other fields may be
    # unset); NULL: every layer.
    bint (*supports)(const ConvGeometry* g) noexcept
    # Writes the plan of a checked call to `plan` and returns the workspace bytes it needs.
    Py_ssize_t (*plan)(const ConvCall* call, void* plan) except -1
    # The kernels: y (N, C_out, Ho, Wo) = conv2d(x, w) + b, and its gradients (dx NULL: no
    # input gradient; db NULL: no bias), in the workspace (cache-line aligned).
    ForwardFloat forward_f
    ForwardDouble forward_d
    BackwardFloat backward_f
    BackwardDouble backward_d


cdef inline object algorithm_capsule(const ConvAlgorithm* a):
    """a, for conv.Algorithm; a must outlive the capsule (module level)."""
    return PyCapsule_New(<void*> a, b"dynar.kernels.conv.ConvAlgorithm", NULL)


cdef inline const ConvAlgorithm* capsule_algorithm(object capsule) except NULL:
    return <const ConvAlgorithm*> PyCapsule_GetPointer(capsule,
                                                       b"dynar.kernels.conv.ConvAlgorithm")


cdef inline ConvGeometry conv_geometry(object x_shape, object w_shape, object stride,
                                       object padding) except *:
    """The geometry of conv2d(x, w) at this stride and padding, or ValueError naming what is
    wrong."""
    # (no generator expressions here: Cython cannot inline them from a .pxd)
    cdef ConvGeometry g
    xs = tuple(x_shape)
    ws = tuple(w_shape)
    if len(xs) != 4:
        raise ValueError(f"x: expected 4 dimensions (N, C, H, W), got shape {xs}")
    if len(ws) != 4:
        raise ValueError(f"w: expected 4 dimensions (C_out, C_in, kh, kw), got shape {ws}")
    if min(xs) < 1:
        raise ValueError(f"x: every dimension must be >= 1, got shape {xs}")
    if min(ws) < 1:
        raise ValueError(f"w: every dimension must be >= 1, got shape {ws}")
    if ws[1] != xs[1]:
        raise ValueError(f"w: expects {ws[1]} input channels, x has {xs[1]}")
    g.sh, g.sw = check_pair("stride", stride, 1)
    g.ph, g.pw = check_pair("padding", padding, 0)
    g.N, g.C, g.H, g.W = xs
    g.Co, g.kh, g.kw = ws[0], ws[2], ws[3]
    check_window_fits("w: kernel", g.kh, g.kw, g.H, g.W, g.ph, g.pw)
    g.Ho = window_positions(g.H, g.kh, g.sh, g.ph)
    g.Wo = window_positions(g.W, g.kw, g.sw, g.pw)
    return g


cdef inline tuple output_shape(const ConvGeometry* g):
    return (g.N, g.Co, g.Ho, g.Wo)


cdef inline ConvCall forward_call(object y, object x, object w, object b, object stride,
                                  object padding) except *:
    """The call y = conv2d(x, w) + b, checked; b may be None."""
    cdef ConvCall c
    memset(&c, 0, sizeof(c))
    c.kind = float_kind("x", x)
    xa = check_float("x", x, 4, c.kind)
    wa = check_float("w", w, 4, c.kind)
    ba = None if b is None else check_float("b", b, 1, c.kind)
    if ba is not None:
        check_shape("b", ba, ((<object> wa).shape[0],))
    ya = check_float("y", y, 4, c.kind, output=True)
    c.g = conv_geometry((<object> xa).shape, (<object> wa).shape, stride, padding)
    check_shape("y", ya, output_shape(&c.g))
    check_disjoint("y", ya, "x", xa)
    check_disjoint("y", ya, "w", wa)
    c.y = data(ya)
    c.x = data(xa)
    c.w = data(wa)
    c.b = data(ba)
    return c


cdef inline ConvCall backward_call(object dx, object dw, object db, object dy, object x,
                                   object w, object stride, object padding) except *:
    """The call for the gradients of conv2d, checked; dx and db may be None."""
    cdef ConvCall c
    memset(&c, 0, sizeof(c))
    c.backward = True
    c.kind = float_kind("x", x)
    xa = check_float("x", x, 4, c.kind)
    wa = check_float("w", w, 4, c.kind)
    dba = None if db is None else check_float("db", db, 1, c.kind, output=True)
    if dba is not None:
        check_shape("db", dba, ((<object> wa).shape[0],))
    dya = check_float("dy", dy, 4, c.kind)
    c.g = conv_geometry((<object> xa).shape, (<object> wa).shape, stride, padding)
    check_shape("dy", dya, output_shape(&c.g))
    dwa = check_float("dw", dw, 4, c.kind, output=True)
    check_shape("dw", dwa, (<object> wa).shape)
    dxa = None
    if dx is not None:
        dxa = check_float("dx", dx, 4, c.kind, output=True)
        check_shape("dx", dxa, (<object> xa).shape)
        for name, other in (("dy", dya), ("x", xa), ("w", wa), ("dw", dwa)):
            check_disjoint("dx", dxa, name, other)
    for name, other in (("dy", dya), ("x", xa), ("w", wa)):
        check_disjoint("dw", dwa, name, other)
    c.dx = data(dxa)
    c.dw = data(dwa)
    c.db = data(dba)
    c.dy = data(dya)
    c.x = data(xa)
    c.w = data(wa)
    return c
