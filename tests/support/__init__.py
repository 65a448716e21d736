"""Helpers the test modules share (fixtures and hooks stay in tests/conftest.py).

    markers     which tests need what: the marker rules, and require_torch()
    threads     at_thread_counts(): one computation on 1 and 2 kernel threads
    bad_inputs  hypothesis strategies for arguments a kernel must refuse, and what it accepts
    photos      image folders cut from the photographs installed packages ship, edge cases

The helpers nearly every kernel test uses can be imported from the package itself.
"""
from support.bad_inputs import assert_zero_sizes_rejected
from support.markers import require_torch
from support.threads import at_thread_counts

__all__ = ["assert_zero_sizes_rejected", "at_thread_counts", "require_torch"]
