"""CrossEntropyLoss: mean softmax cross-entropy of logits against int64 class labels, with
label smoothing as torch's: the target is (1 - eps) onehot + eps / K over the K classes."""
import numpy as np

from ..kernels.loss import softmax_cross_entropy_backward, softmax_cross_entropy_forward


class CrossEntropyLoss:
    def __init__(self, label_smoothing=0.0):
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got "
                             f"{label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self._probs = self._dlogits = self._labels = None

    def forward(self, logits, labels):
        """Mean loss as a Python float; labels: (N,) class indices (int64 avoids a copy)."""
        self._labels = np.ascontiguousarray(labels, dtype=np.int64)
        if self._probs is None or self._probs.shape != logits.shape:
            self._probs = np.empty(logits.shape, np.float32)
        loss = softmax_cross_entropy_forward(self._probs, logits, self._labels)
        if self.label_smoothing:
            # -sum_k q_k log p_k with q = (1 - eps) onehot + eps/K is the cross-entropy plus
            # eps (z_label - mean_k z_k), both averaged over the batch (log p = z - lse).
            picked = np.take_along_axis(logits, self._labels[:, None], axis=1)
            loss += self.label_smoothing * (float(picked.mean(dtype=np.float64))
                                            - float(logits.mean(dtype=np.float64)))
        return loss

    __call__ = forward

    def backward(self, scale=1.0):
        """d(scale x mean loss)/d(logits) for the last forward: (N, K), a buffer reused across
        calls (scale 1/n for one of n micro-batches whose mean is the loss)."""
        if self._dlogits is None or self._dlogits.shape != self._probs.shape:
            self._dlogits = np.empty(self._probs.shape, np.float32)
        softmax_cross_entropy_backward(self._dlogits, self._probs, self._labels, scale)
        if self.label_smoothing:
            # p - q = (p - onehot) + eps (onehot - 1/K)
            n, k = self._dlogits.shape
            coef = np.float32(self.label_smoothing * scale / n)
            self._dlogits -= coef / k
            np.add.at(self._dlogits, (np.arange(n), self._labels), coef)
        return self._dlogits
