"""Fixtures and hooks for the whole suite. Helpers the tests import are in tests/support/."""
import os

import numpy as np
import pytest

from support import markers

# Training runs choose each convolution by the built-in thresholds, not by timing: the suite's
# figures then do not depend on what the machine measured, and no run pays for the timing.
# tests/test_kernel_tuning.py times them, with caches of its own.
os.environ.setdefault("DYNAR_KERNEL_TUNE", "0")


def pytest_collection_modifyitems(items):
    markers.mark_by_calls(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # So that a helper can tell whether the test calling it carries the marker it needs.
    with markers.running(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with markers.check_mpi_stays_out(item):
        return (yield)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
