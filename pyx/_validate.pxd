# Argument checks for the Python-visible kernel entry points.
#
# Every def in pyx/ validates here before it releases the GIL, so nogil code only ever sees
# C-contiguous arrays of the right dtype and shape. Errors name the argument: TypeError for a
# wrong type or dtype, ValueError for a wrong shape, size or layout.
# Every module that cimports this must call cnp.import_array() at module level.
cimport numpy as cnp
from cpython.number cimport PyNumber_Index
from libc.math cimport isfinite

# Element kinds the kernels are instantiated for (cython.floating): float32 trains, float64
# exists for gradient checks.
cdef enum FloatKind:
    F32 = 0
    F64 = 1

cdef inline str _describe(object arr):
    if isinstance(arr, cnp.ndarray):
        return f"{arr.dtype} array of shape {arr.shape}"
    return type(arr).__name__


cdef inline FloatKind float_kind(str name, object arr) except *:
    """The float kind of `arr`, which must be a float32 or float64 ndarray."""
    if not isinstance(arr, cnp.ndarray):
        raise TypeError(f"{name}: expected a float32 or float64 numpy array, got {_describe(arr)}")
    cdef int t = cnp.PyArray_TYPE(<cnp.ndarray> arr)
    if t == cnp.NPY_FLOAT32:
        return F32
    if t == cnp.NPY_FLOAT64:
        return F64
    raise TypeError(f"{name}: expected a float32 or float64 array, got {_describe(arr)}")


cdef inline cnp.ndarray check_array(str name, object arr, int ndim, int typenum,
                                    bint output=False):
    """`arr` as an ndarray of dtype `typenum` and `ndim` dimensions, C-contiguous (and
    writeable when it is an output), else TypeError/ValueError naming `name`."""
    if not isinstance(arr, cnp.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {_describe(arr)}")
    cdef cnp.ndarray a = <cnp.ndarray> arr
    if cnp.PyArray_TYPE(a) != typenum:
        raise TypeError(f"{name}: expected dtype {cnp.PyArray_DescrFromType(typenum)}, "
                        f"got {_describe(arr)}")
    if not cnp.PyArray_ISNOTSWAPPED(a):   # '>f4' has float32's type number too
        raise TypeError(f"{name}: expected native byte order, got {_describe(arr)}")
    if cnp.PyArray_NDIM(a) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {_describe(arr)}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
        raise ValueError(f"{name}: must be C-contiguous and aligned (use np.ascontiguousarray)")
    if output and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{name}: output array is read-only")
    return a


cdef inline int float_typenum(FloatKind kind) noexcept:
    return cnp.NPY_FLOAT32 if kind == F32 else cnp.NPY_FLOAT64


cdef inline cnp.ndarray check_float(str name, object arr, int ndim, FloatKind kind,
                                    bint output=False):
    return check_array(name, arr, ndim, float_typenum(kind), output)


cdef inline object check_shape(str name, cnp.ndarray a, tuple expected):
    """ValueError naming `name` unless a.shape == expected."""
    cdef tuple shape = (<object> a).shape
    if shape != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {shape}")


cdef inline object as_int(str name, object value):
    """A Python int from an int-like value (not bool, not float), else TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return int(PyNumber_Index(value))
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


cdef inline double check_real(str name, object value) except? -1:
    """value as a finite float (a Python or numpy real, not bool), else TypeError/ValueError
    naming `name`."""
    # numpy's bools (np.bool_, a 0-d bool array) convert to float as Python's do.
    if isinstance(value, (bool, str, bytes)) or getattr(value, "dtype", None) == bool:
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    try:
        result = float(value)
    except OverflowError:
        raise ValueError(f"{name}: must be finite, got {value!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from None
    if isinstance(value, complex) or not isfinite(result):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return result


cdef inline tuple check_pair(str name, object value, Py_ssize_t minimum):
    """An int or a pair of ints (height, width), each >= minimum."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or a pair (h, w), got {value!r}")
        items = tuple(value)
    else:
        items = (value, value)
    items = (as_int(name, items[0]), as_int(name, items[1]))
    if items[0] < minimum or items[1] < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value!r}")
    if items[0] > 1 << 40 or items[1] > 1 << 40:
        raise ValueError(f"{name}: unreasonably large, got {value!r}")
    return items


cdef inline int check_blas_dim(str what, Py_ssize_t value) except -1:
    """BLAS takes 32-bit ints: a GEMM dimension past 2^31-1 would silently wrap."""
    if value > 2147483647:
        raise ValueError(f"{what} = {value} exceeds the BLAS 32-bit dimension limit")
    return <int> value


cdef inline object check_disjoint(str out_name, cnp.ndarray out, str in_name, cnp.ndarray inp):
    """Kernels that read `inp` after writing `out` need the two not to overlap."""
    cdef char* o = <char*> cnp.PyArray_DATA(out)
    cdef char* i = <char*> cnp.PyArray_DATA(inp)
    if o < i + cnp.PyArray_NBYTES(inp) and i < o + cnp.PyArray_NBYTES(out) \
            and cnp.PyArray_NBYTES(out) > 0 and cnp.PyArray_NBYTES(inp) > 0:
        raise ValueError(f"{out_name} must not overlap {in_name}")


cdef inline void* data(object a):
    """Data pointer of a validated array, NULL for None (an optional argument left out)."""
    if a is None:
        return NULL
    return cnp.PyArray_DATA(<cnp.ndarray> a)
