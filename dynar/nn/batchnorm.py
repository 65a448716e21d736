"""BatchNorm2d: per-channel batch normalization with running statistics, as torch's."""
import numpy as np

from ..kernels.batchnorm import batchnorm2d_backward, batchnorm2d_forward
from .module import Module
from .parameter import Parameter


class BatchNorm2d(Module):
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
        self._batch_stats = True

    def forward(self, x):
        self._y = self._reuse(self._y, x.shape)
        batchnorm2d_forward(self._y, self._mean, self._invstd, x, self.weight.data,
                            self.bias.data, self.running_mean, self.running_var, self.training,
                            self.momentum, self.eps)
        if self.training:
            self.num_batches_tracked += 1
        # backward must differentiate the normalization this forward used, whatever mode
        # the model is in by then
        self._batch_stats = self.training
        self._x = x
        return self._y

    def backward(self, dy):
        # d(input) is always computed: a BatchNorm is never a model's first layer here.
        self._dx = self._reuse(self._dx, self._x.shape)
        batchnorm2d_backward(self._dx, self.weight.grad, self.bias.grad, dy, self._x,
                             self.weight.data, self._mean, self._invstd, self._batch_stats)
        self._grad_ready()
        return self._dx

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"
