import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def at_thread_counts(run, counts=(1, 2)):
    """[run() with dynar's kernels on n threads for n in counts]; the thread count is
    restored afterwards."""
    from dynar.kernels import threads
    before = threads.get_num_threads()
    try:
        results = []
        for n in counts:
            threads.set_num_threads(n)
            results.append(run())
        return results
    finally:
        threads.set_num_threads(before)


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


def require_torch():
    """torch, or a visible skip where it is not installed (CI installs torch==2.13.0)."""
    return pytest.importorskip("torch", reason="PyTorch parity tests need `pip install torch==2.13.0`")


@pytest.fixture(params=["panel", "blas"])
def weights_gemm(request):
    """Runs the test with the products with the weights (im2col's and Winograd's) on dynar's
    panel GEMM, then on BLAS (set_panel_gemm); the build's defaults are restored after."""
    from dynar.kernels import conv, winograd
    before = [module.set_panel_gemm(request.param == "panel") for module in (conv, winograd)]
    yield request.param
    for module, setting in zip((conv, winograd), before):
        module.set_panel_gemm(setting)
