"""Module: the base of every layer and model.

No autograd tape: `forward(x)` runs the layer and keeps what its own backward needs,
`backward(dy)` consumes that and returns d(input). A model's backward calls its children's in
reverse. Parameter gradients are accumulated (+=) until `zero_grad()`; after
`zero_grad(lazy=True)` the next backward writes them (=) instead, which spares a pass over
all of them.

Arrays a layer returns are reused buffers, never allocated per step (that would cost more
than LeNet's whole step): a layer alone keeps its own, reused on the next call; the layers of
a model take them from the model's StepArena (arena.py), which lays a whole step's out in one
block by when each is alive. Either way a caller that needs a value beyond the next
forward/backward copies it. backward(dy) may overwrite dy (in-place ReLU), so a module that
feeds one dy to two branches gives it first to the branch that only reads it.
"""
from collections import namedtuple

import numpy as np

from .parameter import FlatPlacement, Parameter

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class HookHandle:
    """Returned by register_grad_ready_hook; remove() unregisters the hook."""

    def __init__(self, hooks, fn):
        self._hooks = hooks
        self._fn = fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Module:
    # Set on a layer by its model's flatten_parameters(): the hook list shared by the whole
    # model and the layer's (start, stop) in the flat buffers. Class defaults make a layer
    # outside a flattened model fire nothing.
    _grad_ready_hooks = ()
    _grad_slice = None
    # False on a model's first layer when the model input is data: it may skip d(input).
    input_requires_grad = True
    flat_params = None
    flat_grads = None
    # Set on every layer of a model by use_arena(): where the arrays a layer keeps from
    # forward to backward and its d(input) come from; a layer alone keeps its own.
    _arena = None
    _dx = None
    # The attributes holding what forward keeps for backward (its input, its output, ...):
    # dropped once the layer's backward has run in a model, so their memory can go.
    _keeps = ()
    # True on a layer with parameters from zero_grad(lazy=True) until its next backward.
    _grads_stale = False

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        # Registration by assignment, as torch: `self.conv1 = Conv2d(...)`. The value also
        # stays a plain attribute, so the hot path reads it without a __getattr__ detour.
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name, array):
        """A non-trainable array saved in state_dict (BatchNorm running statistics)."""
        self._buffers[name] = array
        object.__setattr__(self, name, array)

    # -- computation -------------------------------------------------------------------

    def forward(self, x):
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, dy):
        raise NotImplementedError(f"{type(self).__name__}.backward")

    def __call__(self, x):
        return self.forward(x)

    def _reuse(self, array, shape, dtype=np.float32):
        """`array` if it has this shape, else a new one: buffers survive across steps."""
        if array is None or array.shape != shape:
            return np.empty(shape, dtype)
        return array

    def _keep(self, held, shape, dtype=np.float32):
        """An array this layer's forward fills and its backward reads (its output, a max
        pool's argmax): from the model's arena, dead once the layer's backward has run;
        a layer alone keeps its own, `held` from the last call when the shape matches."""
        if self._arena is not None:
            return self._arena.take(shape, dtype, owner=self)
        return self._reuse(held, shape, dtype)

    def _grad_buffer(self, shape):
        """The array d(input) of this backward goes into: from the model's arena, dead
        once the layer before has consumed it; a layer alone keeps its own (`_dx`)."""
        if self._arena is not None:
            return self._arena.take(shape)
        self._dx = self._reuse(self._dx, shape)
        return self._dx

    def input_needed_in_backward(self):
        """What this layer's backward reads of its input: "float32" (the array itself; the
        default, always safe), "bf16" (a bf16 copy of it will do: an operand of bf16
        products) or None (nothing: a pool keeps its argmax, a dropout its mask)."""
        return "float32"

    def keep_output_as_bf16(self, wanted):
        """Whether this layer, asked (`wanted`) by the container running it, keeps only a
        bf16 copy of its next output for its backward, so that the output's float32 memory
        can go once the next layer's forward has read it (a ReLU in bf16: docs/DESIGN.md,
        "Precision")."""
        return False

    def _forward_through(self, layers, x):
        """x through `layers`' forward, first to last. In a model, a layer whose output
        the next one needs in backward as bf16 at most keeps a bf16 copy of it for its own
        backward, and the float32 output goes back to the arena after the next forward."""
        arena = self._arena
        if arena is None:
            for layer in layers:
                x = layer.forward(x)
            return x
        copied = [layer.keep_output_as_bf16(after.input_needed_in_backward() != "float32")
                  for layer, after in zip(layers, layers[1:])]
        for i, layer in enumerate(layers):
            y = layer.forward(x)
            if i and copied[i - 1]:
                arena.passed_on(x, y)
            x = y
        return x

    def _backward_through(self, layers, dy):
        """dy through `layers`' backward, last to first; in a model each layer's kept
        arrays and each gradient (dy included) go back to the arena once consumed."""
        arena = self._arena
        d = dy
        for layer in reversed(layers):
            dx = layer.backward(d)
            if arena is not None:
                layer._release_kept()
                arena.passed_on(d, dx)
            d = dx
        return d

    def _release_kept(self):
        """This layer's backward has run: what its forward kept is dead until the next
        forward. Gives it back to the arena and drops the references to it."""
        self._arena.done_with(self)
        for name in self._keeps:
            object.__setattr__(self, name, None)

    def use_arena(self, arena):
        """Every layer of this module takes what it keeps and its d(input) from `arena`
        (a StepArena), whose passes the caller begins (dynar.models' Model does both)."""
        for m in self.modules():
            object.__setattr__(m, "_arena", arena)
        return self

    def _overwrite_grads(self):
        """Called once by a layer's backward before it writes its parameter gradients:
        True when zero_grad(lazy=True) came first, so they are to be overwritten, not
        added to. From then on they hold this backward's values."""
        stale = self._grads_stale
        self._grads_stale = False
        return stale

    def _zero_stale_grads(self):
        """_overwrite_grads() for a backward whose kernels can only add: the zeroing a lazy
        zero_grad() put off, done here, one layer's gradients at a time."""
        if self._overwrite_grads():
            for p in self._parameters.values():
                p.grad.fill(0)

    def _grad_ready(self):
        """Called by a layer's backward once its parameter gradients are final."""
        if self._grads_stale:   # added into stale values, or about to be swept to zero
            raise RuntimeError(f"{type(self).__name__}.backward wrote its gradients without "
                               "_overwrite_grads() or _zero_stale_grads() first")
        for fn in self._grad_ready_hooks:
            fn(*self._grad_slice)

    def set_input_requires_grad(self, flag):
        """Whether backward must return d(input). A model whose input is data sets False,
        and its first layer then skips that gradient (the largest one in a CNN)."""
        object.__setattr__(self, "input_requires_grad", bool(flag))
        return self

    # -- tree ----------------------------------------------------------------------------

    def named_children(self):
        return iter(self._modules.items())

    def children(self):
        return iter(self._modules.values())

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return (m for _, m in self.named_modules())

    def named_parameters(self):
        for prefix, m in self.named_modules():
            for name, p in m._parameters.items():
                yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def named_buffers(self):
        for prefix, m in self.named_modules():
            for name, b in m._buffers.items():
                yield (f"{prefix}.{name}" if prefix else name), b

    def batch_norm_layers(self):
        """The modules of this one that normalize over a batch (BatchNorm2d): the layers whose
        `batch_stats_group` data-parallel training sets."""
        return [m for m in self.modules() if hasattr(type(m), "batch_stats_group")]

    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    # -- flat buffers and gradient-ready hooks ----------------------------------------------

    def flatten_parameters(self):
        """Move every parameter into one flat float32 buffer (`flat_params`) and every
        gradient into another (`flat_grads`); each Parameter's data/grad become views.

        Layers are laid out in the order backward finalizes their gradients (the last layer
        first; within a layer weight then bias), which is the reverse of registration
        order because every model here registers its layers in forward order and runs
        backward in exact reverse. A gradient bucket of the synchronizer is then one
        contiguous slice of flat_grads, filled front to back as backward proceeds.
        Gradients restart at zero. Models from dynar.models call this when built."""
        layers = [(name, m) for name, m in self.named_modules() if m._parameters][::-1]
        total = sum(p.size for _, m in layers for p in m._parameters.values())
        flat_params = np.empty(total, np.float32)
        flat_grads = np.zeros(total, np.float32)
        hooks = []
        order = []
        start = 0
        for name, m in layers:
            layer_start = start
            names = []
            for pname, p in m._parameters.items():
                stop = start + p.size
                flat_params[start:stop] = p.data.reshape(-1)
                p.placement = FlatPlacement(None, None, start)
                names.append(f"{name}.{pname}" if name else pname)
                start = stop
            object.__setattr__(m, "_grad_slice", (layer_start, start))
            object.__setattr__(m, "_grad_ready_hooks", hooks)
            order.append((name, names, layer_start, start))
        object.__setattr__(self, "_grad_ready_hooks", hooks)
        object.__setattr__(self, "_grad_order", order)
        object.__setattr__(self, "flat_params", flat_params)
        object.__setattr__(self, "flat_grads", flat_grads)
        return self.place_flat_buffers(flat_params, flat_grads)

    def place_flat_buffers(self, flat_params, flat_grads):
        """Make these arrays (1-D float32, the size of the flat buffers) the model's
        flat_params and flat_grads: every Parameter's data and grad become views into them,
        at the same places. Nothing is copied; the caller fills them. Distributed training
        uses this to keep parameters in memory the ranks of a node share (dist/node_replica.py)."""
        self._require_flat("place_flat_buffers")
        for array, what in ((flat_params, "flat_params"), (flat_grads, "flat_grads")):
            if array.dtype != np.float32 or array.shape != self.flat_params.shape \
                    or not array.flags.c_contiguous or not array.flags.writeable:
                raise ValueError(f"place_flat_buffers: {what} must be a writeable contiguous "
                                 f"float32 array of shape {self.flat_params.shape}, got "
                                 f"{array.dtype} {array.shape}")
        for p in self.parameters():
            start = p.placement.offset
            p.data = flat_params[start:start + p.size].reshape(p.shape)
            p.grad = flat_grads[start:start + p.size].reshape(p.shape)
            p.placement = FlatPlacement(flat_params, flat_grads, start)
        object.__setattr__(self, "flat_params", flat_params)
        object.__setattr__(self, "flat_grads", flat_grads)
        return self

    def grad_ready_order(self):
        """[(layer name, [parameter names], start, stop)] in the order backward finalizes
        them; [start, stop) is the layer's slice of flat_grads. The slices tile it."""
        self._require_flat("grad_ready_order")
        return list(self._grad_order)

    def register_grad_ready_hook(self, fn):
        """Call fn(start, stop) during backward the moment flat_grads[start:stop] (one
        layer's parameter gradients) is final; returns a handle whose remove() undoes it."""
        self._require_flat("register_grad_ready_hook")
        self._grad_ready_hooks.append(fn)
        return HookHandle(self._grad_ready_hooks, fn)

    def _require_flat(self, what):
        if self.flat_grads is None:
            raise RuntimeError(f"{what}: call flatten_parameters() on the model first "
                               "(models from dynar.models are flattened when built)")

    def zero_grad(self, lazy=False):
        """Every parameter gradient to zero. lazy: not now, but by the next backward, each
        layer overwriting its gradients instead of adding to them (a dynar.models Model's
        backward zeroes those of layers it did not reach). Until that backward the
        gradients hold stale values: read them after it, as PyTorch's after
        zero_grad(set_to_none=True)."""
        for m in self.modules():
            if m._parameters:
                m._grads_stale = bool(lazy)
        if lazy:
            return
        if self.flat_grads is not None:
            self.flat_grads.fill(0)
        else:
            for p in self.parameters():
                p.grad.fill(0)

    # -- state ---------------------------------------------------------------------------

    def _state_arrays(self):
        """name -> the live array behind that state_dict entry, in torch's order (per module:
        parameters, then buffers; modules in registration order)."""
        state = {}
        for prefix, m in self.named_modules():
            for name, p in m._parameters.items():
                state[f"{prefix}.{name}" if prefix else name] = p.data
            for name, b in m._buffers.items():
                state[f"{prefix}.{name}" if prefix else name] = b
        return state

    def state_dict(self):
        """name -> copy of each parameter and buffer, names and shapes as torch's."""
        return {name: array.copy() for name, array in self._state_arrays().items()}

    def load_state_dict(self, state_dict, strict=True, missing_ok=()):
        """Copy arrays (numpy, or anything np.asarray takes, e.g. CPU torch tensors) into the
        model in place. A missing `num_batches_tracked` is tolerated, and so are the keys in
        `missing_ok` (left as they are). Shape mismatches always raise; with strict, missing
        and unexpected keys raise too, each kind listed (the first ten). Nothing is copied
        unless everything checks out. Returns (missing_keys, unexpected_keys)."""
        own = self._state_arrays()
        missing = [k for k in own if k not in state_dict and k not in missing_ok
                   and not k.endswith("num_batches_tracked")]
        unexpected = [k for k in state_dict if k not in own]
        values = {k: np.asarray(v) for k, v in state_dict.items() if k in own}
        mismatched = [f"{k}: checkpoint {v.shape}, model {own[k].shape}"
                      for k, v in values.items() if v.shape != own[k].shape]
        problems = []
        if mismatched:
            problems.append("shape mismatch for " + _listed(mismatched, "; "))
        if strict and missing:
            problems.append("missing keys " + _listed(missing))
        if strict and unexpected:
            problems.append("unexpected keys " + _listed(unexpected))
        if problems:
            raise ValueError(f"load_state_dict into {type(self).__name__}: "
                             + " | ".join(problems))
        for k, v in values.items():
            np.copyto(own[k], v, casting="same_kind")
        return IncompatibleKeys(missing, unexpected)

    # -- display -------------------------------------------------------------------------

    def extra_repr(self):
        return ""

    def __repr__(self):
        if not self._modules:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"{type(self).__name__}("]
        for name, child in self._modules.items():
            lines.append(f"  ({name}): " + repr(child).replace("\n", "\n  "))
        return "\n".join(lines + [")"])


def _listed(items, separator=", ", shown=10):
    """The first `shown` items joined, and how many more there are."""
    more = f" ... and {len(items) - shown} more" if len(items) > shown else ""
    return separator.join(items[:shown]) + more
