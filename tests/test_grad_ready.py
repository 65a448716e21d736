"""The grad-ready protocol (docs/DESIGN.md): every layer reports its gradients final once,
in the order backward finalizes the flat buffer, and a layer that breaks it is named."""
import numpy as np
import pytest

from dynar import nn

pytestmark = pytest.mark.mpi      # the synchronizer runs on MPI_COMM_SELF in this process


class _Silent(nn.Linear):
    """A layer whose backward forgets to report."""

    def _grad_ready(self):
        pass


class _Swapped(nn.Module):
    """Registers `first` then `second` but runs second first: backward then finalizes
    `first` before `second`, the reverse of the flat buffer's order."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.first = nn.Linear(4, 4, generator=rng)
        self.second = nn.Linear(4, 4, generator=rng)

    def forward(self, x):
        return self.first.forward(self.second.forward(x))

    def backward(self, dy):
        return self.second.backward(self.first.backward(dy))


def _synchronizer(model, mode):
    runtime = pytest.importorskip("dynar.dist.runtime")
    from dynar.dist.sync import GradientSynchronizer
    return GradientSynchronizer(model, runtime.mpi().COMM_SELF, mode)


def _backward(model):
    x = np.ones((2, 4), np.float32)
    model.zero_grad()
    model.backward(np.ones_like(model.forward(x)))


@pytest.mark.parametrize("mode", ["buckets", "fused", "dynamic"])
@pytest.mark.parametrize("silent, error", [
    (0, "layer '0' never reported"),      # the last to finish backward: found in finish()
    (1, "layer '1' had not reported its gradients final when layer '0' did")])
def test_a_layer_that_never_reports_is_named(mode, silent, error):
    from dynar.dist.sync import GradReadyError
    rng = np.random.default_rng(0)
    layers = [nn.Linear(4, 4, generator=rng) for _ in range(3)]
    layers[silent] = _Silent(4, 4, generator=rng)
    model = nn.Sequential(*layers).flatten_parameters()
    sync = _synchronizer(model, mode)
    try:
        with pytest.raises(GradReadyError, match=error):
            _backward(model)
            sync.finish()
    finally:
        sync.close()


def test_a_layer_reporting_out_of_order_is_named():
    from dynar.dist.sync import GradReadyError
    model = _Swapped().flatten_parameters()
    sync = _synchronizer(model, "buckets")
    try:
        with pytest.raises(GradReadyError, match="layer 'second' had not reported its "
                                                 "gradients final when layer 'first' did"):
            _backward(model)
    finally:
        sync.close()


def test_a_layer_reporting_twice_is_named():
    from dynar.dist.sync import GradReadyError
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(4, 4, generator=rng)).flatten_parameters()
    sync = _synchronizer(model, "buckets")
    try:
        _backward(model)
        with pytest.raises(GradReadyError, match="layer '0' reported its gradients final twice"):
            model[0]._grad_ready()
    finally:
        sync.close()


def test_models_that_keep_the_protocol_pass_step_after_step():
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(4, 4, generator=rng), nn.ReLU(),
                          nn.Linear(4, 4, generator=rng)).flatten_parameters()
    sync = _synchronizer(model, "buckets")
    try:
        for _ in range(3):
            _backward(model)
            assert sync.finish() >= 0
    finally:
        sync.close()
