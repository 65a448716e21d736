"""BatchNorm2d: per-channel batch normalization with running statistics, as torch's; when
trained across processes, over the batch of all of them (as torch's SyncBatchNorm) or over
each process's own share."""
import numpy as np

from ..kernels.batchnorm import (batchnorm2d_backward, batchnorm2d_forward,
                                 batchnorm2d_forward_with_statistics, batchnorm2d_gradient_sums,
                                 batchnorm2d_input_gradient, batchnorm2d_sums)
from .module import Module
from .parameter import Parameter


class BatchNorm2d(Module):
    """`batch_stats_group`: None (a model used alone) normalizes each training batch over
    itself. Data-parallel training (dynar.dist.DataParallel) sets it on every BatchNorm of
    the model to the ranks the statistics are taken over: an object whose
    allreduce_sum(array) replaces a 1-D float64 array, in place, by its sum over them, the
    same bytes on each, every member calling it in the same order. Each training forward
    then sums the channel sums of x over the group twice (for the mean, then for the
    variance about it) and each backward sums sum(dy) and sum(dy xhat): every rank
    normalizes with the global batch's statistics and differentiates through them."""
    batch_stats_group = None

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
        self._x = self._y = self._dx = None
        self._mean = np.empty(num_features, np.float32)
        self._invstd = np.empty(num_features, np.float32)
        # What forward used, for backward: batch statistics or running ones, and over which
        # group (whatever mode or group the layer has by then).
        self._batch_stats = True
        self._group = None
        self._count = 0
        # float64 sums over the group: the channel sums and this rank's value count; the
        # squared deviations; backward's two reductions.
        self._sums = np.empty(num_features + 1, np.float64)
        self._squares = np.empty(num_features, np.float64)
        self._gradient_sums = np.empty((2, num_features), np.float64)

    def forward(self, x):
        self._y = self._reuse(self._y, x.shape)
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
        C = self.num_features
        sums, squares = self._sums, self._squares
        batchnorm2d_sums(sums[:C], x)
        sums[C] = x.size // C
        self._group.allreduce_sum(sums)
        # The count is a sum of integers: rounding undoes any error of the group's sum.
        self._count = count = int(round(sums[C]))
        mean = sums[:C] / count
        batchnorm2d_sums(squares, x, mean)
        self._group.allreduce_sum(squares)
        batchnorm2d_forward_with_statistics(self._y, self._mean, self._invstd, x,
                                            self.weight.data, self.bias.data,
                                            self.running_mean, self.running_var, mean,
                                            squares / count, count, self.momentum, self.eps)

    def backward(self, dy):
        # d(input) is always computed: a BatchNorm is never a model's first layer here.
        self._dx = self._reuse(self._dx, self._x.shape)
        if self._group is None:
            batchnorm2d_backward(self._dx, self.weight.grad, self.bias.grad, dy, self._x,
                                 self.weight.data, self._mean, self._invstd, self._batch_stats)
            self._grad_ready()
            return self._dx
        sums = self._gradient_sums
        batchnorm2d_gradient_sums(sums, self.weight.grad, self.bias.grad, dy, self._x,
                                  self._mean, self._invstd)
        self._group.allreduce_sum(sums.reshape(-1))
        # The parameter gradients (this rank's share) were final before the sum, but
        # reporting them after it keeps a bucket they complete from going ahead of this
        # short, blocking sum where MPI lets one thread at a time communicate; their bucket
        # still leaves before d(input) is computed.
        self._grad_ready()
        batchnorm2d_input_gradient(self._dx, dy, self._x, self.weight.data, self._mean,
                                   self._invstd, sums, self._count)
        return self._dx

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"
