"""CrossEntropyLoss: mean softmax cross-entropy of logits against int64 class labels."""
import numpy as np

from ..kernels.loss import softmax_cross_entropy_backward, softmax_cross_entropy_forward


class CrossEntropyLoss:
    def __init__(self):
        self._probs = self._dlogits = self._labels = None

    def forward(self, logits, labels):
        """Mean loss as a Python float; labels: (N,) class indices (int64 avoids a copy)."""
        self._labels = np.ascontiguousarray(labels, dtype=np.int64)
        if self._probs is None or self._probs.shape != logits.shape:
            self._probs = np.empty(logits.shape, np.float32)
        return softmax_cross_entropy_forward(self._probs, logits, self._labels)

    __call__ = forward

    def backward(self):
        """d(mean loss)/d(logits) for the last forward: (N, K), a buffer reused across calls."""
        if self._dlogits is None or self._dlogits.shape != self._probs.shape:
            self._dlogits = np.empty(self._probs.shape, np.float32)
        softmax_cross_entropy_backward(self._dlogits, self._probs, self._labels)
        return self._dlogits
