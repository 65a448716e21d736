"""BatchNorm2d: per-channel batch normalization with running statistics, as torch's; when
trained across processes, over the batch of all of them (as torch's SyncBatchNorm) or over
each process's own share."""
import numpy as np

from ..kernels.batchnorm import (batchnorm2d_backward, batchnorm2d_forward,
                                 batchnorm2d_forward_with_statistics, batchnorm2d_gradient_sums,
                                 batchnorm2d_input_gradient, batchnorm2d_shard_sums)
from .module import Module
from .parameter import Parameter


class BatchNorm2d(Module):
    """`batch_stats_group`: None (a model used alone) normalizes each training batch over
    itself. Data-parallel training (dynar.dist.DataParallel) sets it on every BatchNorm of
    the model to the ranks the statistics are taken over: an object whose
    allreduce_sum(array) replaces a 1-D float64 array, in place, by its sum over them, the
    same bytes on each, every member calling it in the same order. Each training forward
    then sums its share's statistics over the group once (shard_statistics) and each
    backward sums sum(dy) and sum(dy xhat), as SyncBatchNorm does: every rank normalizes
    with the global batch's statistics and differentiates through them."""
    batch_stats_group = None
    _keeps = ("_x", "_y")

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        if momentum is None:
            raise ValueError("BatchNorm2d: momentum=None (cumulative average) is not supported")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = Parameter(np.ones(num_features, np.float32))
        self.bias = Parameter(np.zeros(num_features, np.float32))
        self.register_buffer("running_mean", np.zeros(num_features, np.float32))
        self.register_buffer("running_var", np.ones(num_features, np.float32))
        self.register_buffer("num_batches_tracked", np.zeros((), np.int64))
        self._x = self._y = None
        self._mean = np.empty(num_features, np.float32)
        self._invstd = np.empty(num_features, np.float32)
        # What forward used, for backward: batch statistics or running ones, and over which
        # group (whatever mode or group the layer has by then).
        self._batch_stats = True
        self._group = None
        self._count = 0
        # float64 sums over the group: forward's shard statistics, backward's two reductions.
        self._statistics = np.empty(group_sum_sizes(num_features)[0], np.float64)
        self._gradient_sums = np.empty((2, num_features), np.float64)

    def forward(self, x):
        self._y = self._keep(self._y, x.shape)
        self._group = self.batch_stats_group if self.training else None
        if self._group is None:
            batchnorm2d_forward(self._y, self._mean, self._invstd, x, self.weight.data,
                                self.bias.data, self.running_mean, self.running_var,
                                self.training, self.momentum, self.eps)
        else:
            self._forward_over_group(x)
        if self.training:
            self.num_batches_tracked += 1
        self._batch_stats = self.training
        self._x = x
        return self._y

    def _forward_over_group(self, x):
        statistics = shard_statistics(x, self._statistics)
        self._group.allreduce_sum(statistics)
        mean, var, self._count = batch_statistics(statistics)
        batchnorm2d_forward_with_statistics(self._y, self._mean, self._invstd, x,
                                            self.weight.data, self.bias.data,
                                            self.running_mean, self.running_var, mean, var,
                                            self._count, self.momentum, self.eps)

    def backward(self, dy):
        # d(input) is always computed: a BatchNorm is never a model's first layer here.
        dx = self._grad_buffer(self._x.shape)
        self._zero_stale_grads()
        if self._group is None:
            batchnorm2d_backward(dx, self.weight.grad, self.bias.grad, dy, self._x,
                                 self.weight.data, self._mean, self._invstd, self._batch_stats)
            self._grad_ready()
            return dx
        sums = self._gradient_sums
        batchnorm2d_gradient_sums(sums, self.weight.grad, self.bias.grad, dy, self._x,
                                  self._mean, self._invstd)
        self._group.allreduce_sum(sums.reshape(-1))
        # The parameter gradients (this rank's share) were final before the sum, but
        # reporting them after it keeps a bucket they complete from going ahead of this
        # short, blocking sum where MPI lets one thread at a time communicate; their bucket
        # still leaves before d(input) is computed.
        self._grad_ready()
        batchnorm2d_input_gradient(dx, dy, self._x, self.weight.data, self._mean,
                                   self._invstd, sums, self._count)
        return dx

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


def group_sum_sizes(channels):
    """The float64 values a BatchNorm over `channels` channels sums over its group in one
    training step: forward's shard statistics, backward's two reductions."""
    return (3 * channels + 1, 2 * channels)


def shard_statistics(x, out):
    """out (3C + 1 float64) = this share of the batch's [channel sums S, squared deviations
    about its own mean M2, S times its own mean, value count n]: added up over the shares,
    batch_statistics() gives the whole batch's mean and variance. Returns out."""
    C = x.shape[1]
    sums, squares, between, count = out[:C], out[C:2 * C], out[2 * C:3 * C], out[3 * C:]
    batchnorm2d_shard_sums(sums, squares, x)
    count[0] = x.size // C
    np.multiply(sums, sums / count[0], out=between)     # the own mean the squares are about
    return out


def batch_statistics(total):
    """(mean, biased variance, count) of a batch from its shares' shard_statistics summed.
    The squared deviations about the batch mean are the shares' own plus a between-shares
    term sum(S_r m_r) - S m (the parallel form of the two-pass variance: one sum over the
    shares instead of two, and float64 keeps the difference exact enough for float32 data);
    for one share the term is exactly 0, so one process gets the fused kernel's figures."""
    C = (total.size - 1) // 3
    sums, squares, between = total[:C], total[C:2 * C], total[2 * C:3 * C]
    # The count is a sum of integers: rounding undoes any error of the group's sum.
    count = int(round(total[3 * C]))
    mean = sums / count
    spread = np.maximum(between - sums * mean, 0.0)
    return mean, (squares + spread) / count, count
