"""The compute core: Cython kernels (built from pyx/) for every layer's forward and backward.

The four convolution algorithms (im2col, winograd, direct, tapgemm) have one interface, each
module's forward, backward and supports (conv.Algorithm; nn/conv_algorithms.py picks one).

Kernels parallelize with OpenMP and call BLAS from inside their parallel regions, so the BLAS
behind scipy.linalg.cython_blas is held to one thread here: two layers of threading on the
same cores would oversubscribe them.
"""
import contextlib
import os

from threadpoolctl import ThreadpoolController

from . import threads
from .threads import get_num_threads, set_num_threads, set_flush_denormals


def _hold_kernel_blas_to_one_thread():
    controller = ThreadpoolController()
    blas = controller.select(user_api="blas")
    # scipy wheels bundle their own OpenBLAS (in scipy.libs); numpy's copy is left alone so a
    # user's `a @ b` keeps its threads. Where both share one library, that one is limited.
    scipy_owned = [c for c in blas.lib_controllers
                   if os.path.basename(os.path.dirname(c.filepath)).startswith("scipy")]
    for lib in scipy_owned or blas.lib_controllers:
        lib.set_num_threads(1)


import scipy.linalg.cython_blas  # noqa: E402,F401  (load the BLAS the kernels call)
_hold_kernel_blas_to_one_thread()



@contextlib.contextmanager
def settings_kept():
    """Within: the thread count and the flush-denormals mode may change (a training run sets
    both); after, they are as before."""
    before = get_num_threads(), threads.flush_denormals_enabled()
    try:
        yield
    finally:
        set_num_threads(before[0])
        set_flush_denormals(before[1])


__all__ = ["threads", "get_num_threads", "set_num_threads", "set_flush_denormals",
           "settings_kept"]
