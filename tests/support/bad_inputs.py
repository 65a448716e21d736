"""Arguments a kernel must refuse, and the rules for the ones it must accept.

Every kernel entry point checks its arguments before it releases the GIL (pyx/_validate.pxd):
a wrong type or dtype is a TypeError, a wrong shape, size, layout or value a ValueError. The
property tests start from a valid call, replace a few of its arguments (spoiled_calls), decide
from the arguments alone, with the helpers below, whether the call is still valid, and then
require REFUSED or a correct result: a bad input accepted fails them, and so does a good one
refused.
"""
import numbers

import numpy as np
import pytest
from hypothesis import event, note, strategies as st

# The exceptions a kernel may refuse a call with; anything else (SystemError, OverflowError,
# IndexError, a crash) is a bug.
REFUSED = (TypeError, ValueError)


def assert_zero_sizes_rejected(fn, arrays, rest=()):
    """fn(*arrays.values(), *rest) is a valid call; with any one dimension of any one array
    set to 0 it must raise a ValueError whose message starts with that array's name."""
    fn(*arrays.values(), *rest)
    for name, arr in arrays.items():
        for dim in range(arr.ndim):
            shape = list(arr.shape)
            shape[dim] = 0
            args = dict(arrays, **{name: np.zeros(shape, arr.dtype)})
            with pytest.raises(ValueError, match=f"^{name}: "):
                fn(*args.values(), *rest)


# -- what the tests draw --------------------------------------------------------------------

# Values in place of any argument. A scalar argument takes some of them (an int seed, a real
# p); an optional array takes None; no array argument takes any other.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(2 ** 63, 2 ** 70),
    st.floats(-2, 2), st.sampled_from([float("nan"), float("inf"), -float("inf"), 10 ** 400]),
    st.text(max_size=2), st.lists(st.floats(-1, 1), max_size=3),
    # numpy scalars, as hyper-parameters often are; np.bool_ is a bool too.
    st.tuples(st.sampled_from([np.float32, np.float64, np.int64, np.bool_]),
              st.floats(-2, 2)).map(lambda t: t[0](t[1])),
)

_DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_]


def _near_shapes(shape):
    """Shapes one edit away from `shape`: a dimension dropped or added, one length changed
    (to 0 as well)."""
    edits = [st.integers(0, len(shape)).map(lambda i: shape[:i] + (1,) + shape[i:])]
    if shape:
        axis = st.integers(0, len(shape) - 1)
        edits.append(axis.map(lambda i: shape[:i] + shape[i + 1:]))
        edits.append(st.tuples(axis, st.integers(0, max(shape) + 1)).map(
            lambda t: shape[:t[0]] + (t[1],) + shape[t[0] + 1:]))
    return st.one_of(edits)


def _misaligned(a):
    """A copy of `a` starting one byte into its buffer (aligned anyway for 1-byte dtypes)."""
    out = np.zeros(a.nbytes + a.itemsize + 1, np.uint8)[1:1 + a.nbytes].view(a.dtype)
    out = out.reshape(a.shape)
    out[...] = a
    return out


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def variants_of(valid):
    """Arrays in place of the array `valid`, with its values where they fit: most are one
    change away from it (another dtype or byte order, a shape one edit away, strided,
    Fortran-ordered, misaligned or read-only memory, a nested list); plain copies are valid
    wherever `valid` is."""
    return st.one_of(
        st.just(valid).map(np.copy),
        st.sampled_from(_DTYPES).map(valid.astype),
        st.just(valid).map(lambda a: a.astype(a.dtype.newbyteorder())),
        _near_shapes(valid.shape).map(lambda shape: np.resize(valid, shape)),
        st.just(valid).map(lambda a: np.repeat(a, 2, axis=-1)[..., ::2]),
        st.just(valid).map(np.asfortranarray),
        st.just(valid).map(_misaligned),
        st.just(valid).map(_read_only),
        st.just(valid).map(np.ndarray.tolist),
    )


@st.composite
def spoiled_calls(draw, valid, values=None):
    """The valid call `valid` (argument name -> value) with 1 to 3 arguments replaced: an
    array by one of its variants_of or by a copy (so that valid calls are drawn often), any
    argument by one of `scalars` or of values[name] when given, or by another argument of
    the call itself (the same object: aliasing)."""
    args = dict(valid)
    values = values or {}
    for name in draw(st.lists(st.sampled_from(list(args)), min_size=1, max_size=3)):
        choices = [scalars, st.sampled_from(list(args)).map(args.get)]
        if isinstance(valid[name], np.ndarray):
            choices += [variants_of(valid[name]), st.just(valid[name]).map(np.copy)]
        if name in values:
            choices.append(values[name])
        args[name] = draw(st.one_of(choices))
    return args


# -- what the kernels accept ----------------------------------------------------------------

def is_array(value, dtype, shape=None, ndim=None, output=False):
    """Whether a kernel takes `value` for an array of `dtype` (with `shape`, or `ndim`
    dimensions): an ndarray of exactly that dtype in the machine's byte order, C-contiguous
    and aligned, and writeable when the kernel writes into it."""
    return (isinstance(value, np.ndarray) and value.dtype == np.dtype(dtype)
            and value.dtype.isnative and value.flags.c_contiguous and value.flags.aligned
            and (shape is None or value.shape == tuple(shape))
            and (ndim is None or value.ndim == ndim)
            and (value.flags.writeable or not output))


def float_dtype(value):
    """The dtype of `value` if it is a float32 or float64 array (the dtypes every kernel is
    built for), else None."""
    if isinstance(value, np.ndarray) and value.dtype in (np.float32, np.float64):
        return value.dtype
    return None


def overlap(args, outputs):
    """Whether any array named in `outputs` shares memory with another argument."""
    return any(isinstance(args[out], np.ndarray) and isinstance(other, np.ndarray)
               and np.shares_memory(args[out], other)
               for out in outputs for name, other in args.items() if name != out)


def as_real(value):
    """`value` as a float if a kernel takes it for a real number (a Python or numpy int or
    float, not a bool), else None; the float may be inf or NaN, which the kernels refuse."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:    # an int past the largest double
        return float("inf")


def as_int(value):
    """`value` as an int if a kernel takes it for an integer (a Python or numpy int, not a
    bool), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def snapshot(args):
    """A copy of every array among the arguments: the reference results are computed from
    these, as outputs may be the inputs themselves."""
    return {name: value.copy() if isinstance(value, np.ndarray) else value
            for name, value in args.items()}


def run_spoiled(call, args, accepted):
    """`call` on spoiled `args`: where `accepted` (the caller's rules) says the call is
    invalid it must raise REFUSED, and None is returned; else it runs, and (the arguments as
    they were before it, its result) is returned for the caller to check."""
    note(describe(args))
    before = snapshot(args)
    if not accepted:
        event("refused")
        with pytest.raises(REFUSED):
            call(*args.values())
        return None
    event("computed")
    return before, call(*args.values())


def describe(args):
    """One line per argument, what the kernel's checks look at (hypothesis prints it for a
    failing call with note(), the values themselves being too long to read)."""
    lines = []
    for name, value in args.items():
        if isinstance(value, np.ndarray):
            flags = value.flags
            aliases = [other for other, v in args.items() if other != name and v is value]
            value = (f"{value.dtype.str} array {value.shape}"
                     f"{'' if flags.c_contiguous else ', not C-contiguous'}"
                     f"{'' if flags.aligned else ', misaligned'}"
                     f"{'' if flags.writeable else ', read-only'}"
                     f"{', the same object as ' + ', '.join(aliases) if aliases else ''}")
        else:
            value = repr(value)[:60]
        lines.append(f"{name} = {value}")
    return "\n".join(lines)
