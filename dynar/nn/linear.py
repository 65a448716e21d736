"""Linear: y = x @ w^T + b over (N, in) float32."""
import numpy as np

from ..kernels.bf16 import matmul
from ..kernels.linear import (COLS, DEFAULT_CUT, DEFAULT_DW_CUT, PANELS, ROWS,
                              bias_gradient, linear_backward, linear_forward)
from . import init, precision
from .module import Module
from .parameter import Parameter
from .precision import Bf16Operands

# How each product's output is cut among threads (pyx/linear.pyx), by what the blocks
# run along: y = x w^T by batch rows or output features, dx = dy w by batch rows or input
# features, dw = dy^T x by output or input features; y and dx also by output or input
# features on dynar's panel GEMM ("panels") instead of BLAS.
AXES = {"y": {"batch": ROWS, "out": COLS, "panels": PANELS},
        "dx": {"batch": ROWS, "in": COLS, "panels": PANELS},
        "dw": {"out": ROWS, "in": COLS}}


def plan_text(cuts):
    """The plan parse_plan reads back as `cuts` ({"y": (axis, width), ...})."""
    def along(product, axis):
        return next(name for name, a in AXES[product].items() if a == axis)
    return " ".join(f"{p}={along(p, cuts[p][0])}/{cuts[p][1]}" for p in AXES)


# The cuts before tuning, and with DYNAR_KERNEL_TUNE=0: the kernels' own defaults (along w,
# 64 rows or columns a block: "y=out/64 dx=in/64 dw=out/64").
DEFAULT_PLAN = plan_text({"y": DEFAULT_CUT, "dx": DEFAULT_CUT, "dw": DEFAULT_DW_CUT})


def parse_plan(plan):
    """{"y": (axis, width), "dx": ..., "dw": ...} of a plan such as DEFAULT_PLAN."""
    cuts = {}
    for part in str(plan).split():
        product, _, cut = part.partition("=")
        along, _, width = cut.partition("/")
        if product not in AXES or product in cuts or along not in AXES[product] \
                or not width.isdigit() or int(width) < 1:
            raise ValueError(f"Linear.plan: expected e.g. {DEFAULT_PLAN!r} (y along batch, out "
                             f"or panels, dx along batch, in or panels, dw along out or in, a "
                             f"width >= 1), got {plan!r}")
        cuts[product] = (AXES[product][along], int(width))
    if set(cuts) != set(AXES):
        raise ValueError(f"Linear.plan: {plan!r} misses {sorted(set(AXES) - set(cuts))}")
    return cuts


class Linear(Bf16Operands, Module):
    _keeps = ("_x", "_x16", "_y")

    def __init__(self, in_features, out_features, bias=True, generator=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        generator = np.random.default_rng() if generator is None else generator
        self.weight = Parameter(np.empty((out_features, in_features), np.float32))
        self.bias = Parameter(np.empty(out_features, np.float32)) if bias else None
        init.torch_default_(self.weight.data, None if self.bias is None else self.bias.data,
                            generator)
        self._y = None
        self.plan = DEFAULT_PLAN

    @property
    def plan(self):
        """How the kernels cut the three products among threads (nn/kernel_tuning.py times
        the choices): e.g. "y=out/64 dx=in/64 dw=out/64"."""
        return self._plan

    @plan.setter
    def plan(self, value):
        self._cuts = parse_plan(value)
        self._plan = value

    def forward(self, x):
        self._y = self._keep(self._y, (x.shape[0], self.out_features))
        self._keep_input(x)
        kernel = self._bf16_kernel()
        if kernel:
            # y = x w^T (+ b), rounding x and w as the kernel packs them.
            self._y[...] = 0 if self.bias is None else self.bias.data
            return matmul(self._y, x, self.weight.data, trans_b=True, accumulate=True,
                          kernel=kernel)
        xr, w, scratch = self._forward_operands(x)
        linear_forward(self._y, xr, w, None if self.bias is None else self.bias.data,
                       self._cuts["y"])
        self._give_back(scratch)
        return self._y

    def backward(self, dy):
        dx = None
        if self.input_requires_grad:
            dx = self._grad_buffer((dy.shape[0], self.in_features))
        kernel = self._bf16_kernel()
        if kernel:
            if dx is not None:
                matmul(dx, dy, self.weight.data, kernel=kernel)           # dy w
            add = not self._overwrite_grads()
            x, widened = self._kept_input()
            matmul(self.weight.grad, dy, x, trans_a=True, accumulate=add,
                   kernel=kernel)                                        # (+)= dy^T x
            self._give_back(widened)
            if self.bias is not None:   # from the rounded dy, as on the portable path
                dyr = self._rounded("_scratch_dy", dy)
                bias_gradient(self.bias.grad, dyr, accumulate=add)
                self._give_back((dyr,))
            self._grad_ready()
            return dx
        dyr, xr, w, scratch = self._backward_operands(dy)
        add = not self._overwrite_grads()
        linear_backward(dx, self.weight.grad, None if self.bias is None else self.bias.grad,
                        dyr, xr, w, self._cuts["dx"], self._cuts["dw"], accumulate=add)
        self._give_back(scratch)
        self._grad_ready()
        return dx

    def _bf16_kernel(self):
        """The bf16 GEMM kernel this layer computes on, or None for its float32 kernels
        (on operands rounded to bf16 in "bf16" precision)."""
        return precision.gemm_kernel() if self.precision == "bf16" else None

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
