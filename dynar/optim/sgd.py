"""SGD with momentum, weight decay and Nesterov, as torch.optim.SGD, as one fused kernel call
over the flat parameter buffer."""
import numpy as np

from ..kernels.sgd import sgd_step
from ..nn import Module


def _contiguous_runs(params, decays):
    """[(flat_params view, flat_grads view, weight decay or None)] covering `params` with as
    few contiguous slices of their models' flat buffers as possible: one for all of a model's
    parameters when they share a weight decay (decays[i]: parameter i's group's, None for the
    optimizer's own)."""
    spans = []
    for p, decay in zip(params, decays):
        if p.placement is None:
            raise ValueError("SGD: parameters must live in a model's flat buffers; call "
                             "model.flatten_parameters() first (dynar.models do it when built)")
        flat_params, flat_grads, start = p.placement
        spans.append((id(flat_params), start, start + p.size, flat_params, flat_grads, decay))
    spans.sort(key=lambda s: s[:2])
    runs = []
    for key, start, stop, flat_params, flat_grads, decay in spans:
        if runs and runs[-1][0] == key and runs[-1][2] > start:
            raise ValueError("SGD: a parameter was given twice")
        if runs and runs[-1][0] == key and runs[-1][2] == start and runs[-1][5] == decay:
            runs[-1][2] = stop
        else:
            runs.append([key, start, stop, flat_params, flat_grads, decay])
    return [(fp[start:stop], fg[start:stop], decay) for _, start, stop, fp, fg, decay in runs]


def _groups(params):
    """(parameters, their groups' weight decays or None) from a Module, an iterable of
    Parameters, or torch-style groups: dicts with "params" and an optional "weight_decay"."""
    if isinstance(params, Module):
        params = list(params.parameters())
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return params, [None] * len(params)
    flat, decays = [], []
    for group in params:
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError("SGD: parameter groups are dicts with 'params' (and optionally "
                             "'weight_decay')")
        other = set(group) - {"params", "weight_decay"}
        if other:
            raise ValueError(f"SGD: a parameter group may set weight_decay only, got "
                             f"{', '.join(sorted(other))}")
        decay = group.get("weight_decay")
        if decay is not None and not decay >= 0:
            raise ValueError(f"SGD: a group's weight_decay must be >= 0, got {decay}")
        members = list(group["params"])
        flat += members
        decays += [decay] * len(members)
    return flat, decays


class SGD:
    """SGD(model.parameters() or model, lr, momentum=0, dampening=0, weight_decay=0,
    nesterov=False); argument order and semantics as torch.optim.SGD. As torch's, `params`
    may be groups, [{"params": [...], "weight_decay": 0.0}, {"params": [...]}, ...], that
    set their own weight decay (the one setting a group may change here).

    `lr` is a plain attribute, which the schedulers in dynar.optim.lr_scheduler set.

    For ranks of a node that share one copy of the parameters (dist/node_replica.py):
    relocate() follows the parameters and the velocity into memory they share, and step(ranges)
    updates only those [(lo, hi), ...] of the parameters laid end to end (this rank's parts;
    the node's other ranks update the rest). state_dict() always holds the whole velocity."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
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
        self._params, self._decays = _groups(params)
        self._runs = _contiguous_runs(self._params, self._decays)
        self.size = sum(p.size for p, _, _ in self._runs)
        self.momentum_buffer = np.zeros(self.size, np.float32) if momentum else None
        self._build_views()

    def _build_views(self):
        self._whole = self._pieces([(0, self.size)])
        # A node replica updates the same ranges every step: their views are built once.
        self._ranges, self._ranged = None, None

    def relocate(self, momentum_buffer=None):
        """Follow the parameters to where their model's flat buffers are now
        (Module.place_flat_buffers) and, given `momentum_buffer` (1-D float32, one element
        per parameter), keep the velocity there from now on. Nothing is copied: the caller
        fills the new buffer. Returns the velocity buffer in use before. The ranks of a node
        sharing one replica move both into shared memory (dist/node_replica.py)."""
        if momentum_buffer is not None:
            if self.momentum_buffer is None:
                raise ValueError("SGD.relocate: this optimizer has no momentum")
            fits = isinstance(momentum_buffer, np.ndarray) and momentum_buffer.dtype == np.float32 \
                and momentum_buffer.shape == (self.size,) and momentum_buffer.flags.writeable
            if not fits:
                got = f"{momentum_buffer.dtype} {momentum_buffer.shape}" \
                    if isinstance(momentum_buffer, np.ndarray) else type(momentum_buffer).__name__
                raise ValueError(f"SGD.relocate: momentum_buffer must be a writeable float32 "
                                 f"array of shape ({self.size},), got {got}")
        previous = self.momentum_buffer
        if momentum_buffer is not None:
            self.momentum_buffer = momentum_buffer
        self._runs = _contiguous_runs(self._params, self._decays)
        self._build_views()
        return previous

    def _pieces(self, ranges):
        """(params, grads, velocity, weight decay) that cover `ranges` of the parameters laid
        end to end, run by run (views; the decay None for the optimizer's own)."""
        pieces = []
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= self.size:
                raise ValueError(f"SGD.step: range ({lo}, {hi}) is not within the "
                                 f"{self.size} parameters")
            start = 0
            for p, g, decay in self._runs:
                a, b = max(lo - start, 0), min(hi - start, p.size)
                if a < b:
                    buf = self.momentum_buffer
                    pieces.append((p[a:b], g[a:b],
                                   None if buf is None else buf[start + a:start + b], decay))
                start += p.size
        return pieces

    def step(self, ranges=None):
        """One update of every parameter, or of `ranges` only (see the class docstring)."""
        # torch copies the first direction into the momentum buffer undamped; from a zero
        # buffer, dampening 0 on the first step gives exactly that
        dampening = self.dampening if self.steps else 0.0
        if ranges is not None and ranges != self._ranges:
            self._ranged, self._ranges = self._pieces(ranges), list(ranges)
        for params, grads, buf, decay in self._whole if ranges is None else self._ranged:
            sgd_step(params, grads, buf, self.lr, self.momentum,
                     self.weight_decay if decay is None else decay, self.nesterov, dampening)
        self.steps += 1

    def zero_grad(self):
        for _, grads, _ in self._runs:
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
