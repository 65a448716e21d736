# Argument checks shared by the two convolution kernels: im2col/GEMM (conv.pyx) and
# Winograd (winograd.pyx) take the same arrays and must reject bad input the same way.
# Every module that cimports this must call cnp.import_array() at module level.
cimport numpy as cnp

from _validate cimport FloatKind, check_disjoint, check_float, check_pair, check_shape, float_kind


cdef inline tuple conv_output_shape(object x_shape, object w_shape, object stride,
                                    object padding):
    """(N, C_out, H_out, W_out), or ValueError naming what is wrong."""
    # (no generator expressions here: Cython cannot inline them from a .pxd)
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
    sh, sw = check_pair("stride", stride, 1)
    ph, pw = check_pair("padding", padding, 0)
    if ws[2] > xs[2] + 2 * ph or ws[3] > xs[3] + 2 * pw:
        raise ValueError(f"w: kernel {ws[2]}x{ws[3]} is larger than the padded input "
                         f"{xs[2] + 2 * ph}x{xs[3] + 2 * pw}")
    return (xs[0], ws[0], (xs[2] + 2 * ph - ws[2]) // sh + 1, (xs[3] + 2 * pw - ws[3]) // sw + 1)


cdef inline tuple check_conv_forward(object y, object x, object w, object b, object stride,
                                     object padding, FloatKind* kind):
    """(y, x, w, b) validated for y = conv2d(x, w) + b; b may be None."""
    kind[0] = float_kind("x", x)
    xa = check_float("x", x, 4, kind[0])
    wa = check_float("w", w, 4, kind[0])
    ba = None if b is None else check_float("b", b, 1, kind[0])
    if ba is not None:
        check_shape("b", ba, ((<object> wa).shape[0],))
    ya = check_float("y", y, 4, kind[0], output=True)
    check_shape("y", ya, conv_output_shape((<object> xa).shape, (<object> wa).shape, stride,
                                           padding))
    check_disjoint("y", ya, "x", xa)
    check_disjoint("y", ya, "w", wa)
    return ya, xa, wa, ba


cdef inline tuple check_conv_backward(object dx, object dw, object db, object dy, object x,
                                      object w, object stride, object padding, FloatKind* kind):
    """(dx, dw, db, dy, x, w) validated for the gradients of conv2d; dx and db may be None."""
    kind[0] = float_kind("x", x)
    xa = check_float("x", x, 4, kind[0])
    wa = check_float("w", w, 4, kind[0])
    dba = None if db is None else check_float("db", db, 1, kind[0], output=True)
    if dba is not None:
        check_shape("db", dba, ((<object> wa).shape[0],))
    dya = check_float("dy", dy, 4, kind[0])
    check_shape("dy", dya, conv_output_shape((<object> xa).shape, (<object> wa).shape, stride,
                                             padding))
    dwa = check_float("dw", dw, 4, kind[0], output=True)
    check_shape("dw", dwa, (<object> wa).shape)
    dxa = None
    if dx is not None:
        dxa = check_float("dx", dx, 4, kind[0], output=True)
        check_shape("dx", dxa, (<object> xa).shape)
        for name, other in (("dy", dya), ("x", xa), ("w", wa), ("dw", dwa)):
            check_disjoint("dx", dxa, name, other)
    for name, other in (("dy", dya), ("x", xa), ("w", wa)):
        check_disjoint("dw", dwa, name, other)
    return dxa, dwa, dba, dya, xa, wa
