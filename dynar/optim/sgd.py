"""SGD with momentum, weight decay and Nesterov, as torch.optim.SGD, as one fused kernel call
over the flat parameter buffer."""
import numpy as np

from ..kernels.sgd import sgd_step
from ..nn import Module


def _contiguous_runs(params):
    """[(flat_params view, flat_grads view)] covering `params` with as few contiguous slices
    of their models' flat buffers as possible: one for all of a model's parameters."""
    spans = []
    for p in params:
        if p.flat_slice is None:
            raise ValueError("SGD: parameters must live in a model's flat buffers; call "
                             "model.flatten_parameters() first (dynar.models do it when built)")
        flat_params, flat_grads, start = p.flat_slice
        spans.append((id(flat_params), start, start + p.size, flat_params, flat_grads))
    spans.sort(key=lambda s: s[:2])
    runs = []
    for key, start, stop, flat_params, flat_grads in spans:
        if runs and runs[-1][0] == key and runs[-1][2] == start:
            runs[-1][2] = stop
        elif runs and runs[-1][0] == key and runs[-1][2] > start:
            raise ValueError("SGD: a parameter was given twice")
        else:
            runs.append([key, start, stop, flat_params, flat_grads])
    return [(fp[start:stop], fg[start:stop]) for _, start, stop, fp, fg in runs]


class SGD:
    """SGD(model.parameters() or model, lr, momentum=0, dampening=0, weight_decay=0,
    nesterov=False); argument order and semantics as torch.optim.SGD, one parameter group.

    `lr` is a plain attribute, which the schedulers in dynar.optim.lr_scheduler set.

    For ranks of a node that share one copy of the parameters (dist.NodeReplica):
    `momentum_storage` is a zeroed float32 array, as long as all parameters together, that
    holds the velocity instead of a private one, and step(ranges) updates only those
    [(lo, hi), ...] of the parameters laid end to end (this rank's parts; the node's other
    ranks update the rest). state_dict() always holds the whole velocity."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, momentum_storage=None):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: lr, momentum and weight_decay must be >= 0, got lr={lr}, "
                             f"momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0")
        self.lr = lr
        self.momentum = momentum
        self.dampening = dampening
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.steps = 0
        self._runs = _contiguous_runs(params.parameters() if isinstance(params, Module)
                                      else params)
        size = sum(p.size for p, _ in self._runs)
        self.momentum_buffer = None
        if momentum:
            self.momentum_buffer = np.zeros(size, np.float32) if momentum_storage is None \
                else momentum_storage
            if self.momentum_buffer.shape != (size,) or self.momentum_buffer.dtype != np.float32:
                raise ValueError(f"SGD: momentum_storage must be float32 of shape ({size},), "
                                 f"got {self.momentum_buffer.dtype} {self.momentum_buffer.shape}")
        self.size = size
        self._whole = self._pieces([(0, size)])
        # A node replica updates the same ranges every step: their views are built once.
        self._ranges, self._ranged = None, None

    def _pieces(self, ranges):
        """(params, grads, velocity) views that cover `ranges` of the parameters laid end to
        end, run by run."""
        pieces = []
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= self.size:
                raise ValueError(f"SGD.step: range ({lo}, {hi}) is not within the "
                                 f"{self.size} parameters")
            start = 0
            for p, g in self._runs:
                a, b = max(lo - start, 0), min(hi - start, p.size)
                if a < b:
                    buf = self.momentum_buffer
                    pieces.append((p[a:b], g[a:b],
                                   None if buf is None else buf[start + a:start + b]))
                start += p.size
        return pieces

    def step(self, ranges=None):
        """One update of every parameter, or of `ranges` only (see the class docstring)."""
        # torch copies the first direction into the momentum buffer undamped; from a zero
        # buffer, dampening 0 on the first step gives exactly that
        dampening = self.dampening if self.steps else 0.0
        if ranges is not None and ranges != self._ranges:
            self._ranged, self._ranges = self._pieces(ranges), list(ranges)
        for params, grads, buf in self._whole if ranges is None else self._ranged:
            sgd_step(params, grads, buf, self.lr, self.momentum, self.weight_decay,
                     self.nesterov, dampening)
        self.steps += 1

    def zero_grad(self):
        for _, grads in self._runs:
            grads.fill(0)

    def state_dict(self):
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov,
                "steps": self.steps,
                "momentum_buffer": None if self.momentum_buffer is None
                else self.momentum_buffer.copy()}

    def load_state_dict(self, state):
        buf = state["momentum_buffer"]
        if (buf is None) != (self.momentum_buffer is None) or (
                buf is not None and np.shape(buf) != self.momentum_buffer.shape):
            have = None if self.momentum_buffer is None else self.momentum_buffer.shape
            raise ValueError(f"SGD.load_state_dict: momentum_buffer "
                             f"{None if buf is None else np.shape(buf)} does not fit this "
                             f"optimizer's {have} (momentum on/off or a different model?)")
        for name in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "steps"):
            setattr(self, name, state[name])
        if buf is not None:
            np.copyto(self.momentum_buffer, buf, casting="same_kind")
