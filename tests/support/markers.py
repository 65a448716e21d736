"""Which tests need what, so that `python -m pytest -m "not mpi and not root"` is a quick run.

The markers are registered in pyproject.toml. A test is marked in one of two ways:

* automatically (mark_by_calls) when it calls a helper that needs something: require_torch()
  needs torch, run_mpi() and mpiexec() an MPI (CALLS_NEEDING). "Calls" counts the test's
  own body, the fixtures of its module it uses and the functions of its module these call;
* by hand, with @pytest.mark.<name> or a module-level `pytestmark`, for the rest (a test that
  needs root, one that loads MPI into the test process).

Either way a miss is caught while the tests run: the helpers check that the running test
carries their marker (expect_marker), and a test that loads mpi4py's MPI into the pytest
process without the `mpi` marker fails (check_mpi_stays_out).
"""
import contextlib
import inspect
import sys

import pytest

# A test that calls one of these is given the marker (mark_by_calls).
CALLS_NEEDING = {"require_torch": "torch", "run_mpi": "mpi", "mpiexec": "mpi"}

_running = []   # the pytest item being run, when there is one


@contextlib.contextmanager
def running(item):
    """Within: `item` is the test being run (conftest wraps every test in this)."""
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def expect_marker(name, needs):
    """Fails the running test unless it is marked `name`; `needs` says why it must be.
    Outside a test run (a script importing the helpers) there is nothing to check."""
    if _running and _running[-1].get_closest_marker(name) is None:
        pytest.fail(f"{_running[-1].nodeid} {needs} but is not marked {name!r}: add "
                    f"@pytest.mark.{name} (markers: pyproject.toml)", pytrace=False)


def _code(function):
    """The code object of a test, fixture or helper function; None for anything else."""
    function = getattr(getattr(function, "hypothesis", None), "inner_test", function)
    return getattr(inspect.unwrap(function), "__code__", None)


def _names_reached(item):
    """Every global or attribute name the test refers to, in its body (lambdas and inner
    functions included), in the fixtures of its module it uses and in the functions of its
    module that any of these refer to, transitively."""
    module = vars(item.module)
    pending = [_code(item.function)] + [_code(module[f]) for f in item.fixturenames
                                        if f in module]
    seen, names = set(), set()
    while pending:
        code = pending.pop()
        if code is None or code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        pending.extend(c for c in code.co_consts if inspect.iscode(c))
        pending.extend(_code(module[name]) for name in code.co_names
                       if inspect.isfunction(module.get(name))
                       and module[name].__module__ == item.module.__name__)
    return names


def mark_by_calls(items):
    """Adds CALLS_NEEDING's marker to every collected test that calls the helper."""
    for item in items:
        if getattr(item, "function", None) is None:
            continue
        for name in sorted(_names_reached(item) & CALLS_NEEDING.keys()):
            item.add_marker(CALLS_NEEDING[name])


@contextlib.contextmanager
def check_mpi_stays_out(item):
    """Fails `item` if it is not marked mpi and loads mpi4py's MPI (which initializes MPI)
    into this process; a no-op once MPI is loaded, as it then stays."""
    loaded = "mpi4py.MPI" in sys.modules
    yield
    if not loaded and "mpi4py.MPI" in sys.modules:
        expect_marker("mpi", "loads mpi4py's MPI into the test process")


def require_torch():
    """torch, or a visible skip where it is not installed (CI installs torch==2.13.0)."""
    expect_marker("torch", "imports PyTorch")
    return pytest.importorskip(
        "torch", reason="PyTorch parity tests need `pip install torch==2.13.0`")
