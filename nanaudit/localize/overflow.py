"""Can an op's result exceed its dtype's range, given its inputs? The largest |result| each op
family can reach from its inputs' magnitudes (|A| x |B| x k terms for a matmul), so that
`dtype-overflow` is claimed only for a value that really can overflow.

One formula per family of ops, keyed on the op's base name, like the domain rules; an op with no
formula has no bound (None), and the diagnosis says so instead of guessing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.ops import dtype_name, op_base


@dataclass(frozen=True)
class Bound:
    """The largest finite result an op can give from its inputs' magnitudes, against the range."""

    bound: float
    largest_input: float
    limit: float
    dtype: torch.dtype
    how: str                     # the formula, for the explanation


def amax(t: Any) -> float:
    """The largest finite |value| of a tensor or number (0 for anything else)."""
    if isinstance(t, (int, float)):
        return abs(float(t))
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) \
            or t.numel() == 0 or released(t):
        return 0.0
    return float(t.detach().abs().double().nan_to_num(0, 0, 0).max())


def _amin(t: torch.Tensor) -> float:
    if not isinstance(t, torch.Tensor) or not t.numel() or released(t):
        return 0.0
    return float(t.detach().abs().double().nan_to_num(0, 0, 0).min())


def released(t: torch.Tensor) -> bool:
    """Is `t`'s memory gone? FSDP2 frees a layer's unsharded weights after its forward (their
    storage resized to 0, the tensor's shape kept): the op read them, but an event kept to
    diagnose later holds a tensor whose read would be out of bounds (a crash, not an error)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False             # a subclass (a DTensor) holds no storage of its own to check
    try:
        return t.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):
        return False


@dataclass(frozen=True)
class _Operands:
    """What a formula reads: the op, its arguments, its floating inputs, the dtype it writes."""

    base: str
    args: tuple
    kwargs: dict
    floats: list
    dtype: torch.dtype
    largest: float               # the largest |input| over the floating inputs

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        return self.args[i] if len(self.args) > i else self.kwargs.get(name, default)


# formula(operands) -> (largest |result|, how it was reached) or None when it cannot say
Formula = Callable[[_Operands], "tuple[float, str] | None"]
FORMULAS: dict[str, Formula] = {}


def _bound_of(*names: str) -> Callable[[Formula], Formula]:
    def register(formula: Formula) -> Formula:
        for name in names:
            if name in FORMULAS:
                raise ValueError(f"{name} has two overflow formulas")
            FORMULAS[name] = formula
        return formula
    return register


MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "dot": (0, 1), "mv": (0, 1),
           "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2),
           "linear": (0, 1)}
# The backward of a convolution has no formula: its result is no product of these inputs.
CONVOLUTIONS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
                "mkldnn_convolution", "_slow_conv2d_forward"}
SUMS = {"sum", "nansum", "cumsum", "mean", "logcumsumexp"}
SQUARES = {"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm",
           "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
           "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "mse_loss"}
CASTS = {"_to_copy", "to", "copy", "_copy_from", "clone", "type_as"}
ATTENTIONS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "scaled_dot_product_attention",
              "_scaled_dot_product_attention_math"}
# Results bounded by the largest input (or a fixed multiple): these never overflow.
BOUNDED = {"relu", "gelu", "silu", "tanh", "sigmoid", "hardtanh", "abs", "neg", "clamp", "where",
           "cat", "stack", "index", "index_select", "gather", "view", "reshape", "expand",
           "permute", "transpose", "t", "slice", "select", "max", "min", "amax", "amin",
           "maximum", "minimum", "_softmax", "softmax", "avg_pool2d", "max_pool2d",
           "max_pool2d_with_indices", "adaptive_avg_pool2d", "upsample_nearest2d", "masked_fill",
           "sort", "topk", "leaky_relu", "elu", "mish", "hardswish", "_unsafe_view", "alias",
           "unsqueeze", "squeeze", "flatten", "contiguous", "detach", "lift_fresh", "split",
           "constant_pad_nd", "roll", "flip", "repeat", "fill", "zero", "scatter", "index_put",
           "embedding", "native_dropout", "dropout"}


def _product_bound(a: Any, b: Any, k: Any) -> Any:
    return amax(a) * amax(b) * k


@_bound_of(*MATMULS)
def _matmul(o: _Operands) -> Any:
    i, j = MATMULS[o.base]
    a, b = o.args[i], o.args[j]
    k = a.shape[-1] if a.dim() else 1
    bound = _product_bound(a, b, k)
    how = f"|A| {amax(a):.4g} x |B| {amax(b):.4g} x {k} terms"
    if i == 1:                   # addmm and kin: beta x bias + alpha x A @ B
        beta = abs(float(o.kwargs.get("beta", 1)))
        alpha = abs(float(o.kwargs.get("alpha", 1)))
        bound = bound * alpha + beta * amax(o.args[0])
        how += f" + |bias| {amax(o.args[0]):.4g}"
    return bound, how


@_bound_of(*CONVOLUTIONS)
def _convolution(o: _Operands) -> Any:
    x, w = o.args[0], o.args[1]
    k = w[0].numel() if w.dim() else 1
    bias = o.args[2] if len(o.args) > 2 and isinstance(o.args[2], torch.Tensor) else None
    return _product_bound(x, w, k) + amax(bias), f"|x| {amax(x):.4g} x |w| {amax(w):.4g} x " \
                                                 f"{k} terms"


@_bound_of("mul")
def _mul(o: _Operands) -> Any:
    other = amax(o.arg(1, "other", 1.0))
    return amax(o.args[0]) * other, f"{amax(o.args[0]):.4g} x {other:.4g}"


@_bound_of("addcmul")
def _addcmul(o: _Operands) -> Any:
    value = abs(float(o.kwargs.get("value", 1)))
    return amax(o.args[0]) + value * amax(o.args[1]) * amax(o.args[2]), \
        "|input| + |value| x |t1| x |t2|"


@_bound_of("add", "sub", "rsub")
def _add(o: _Operands) -> Any:
    alpha = abs(float(o.kwargs.get("alpha", 1)))
    a, b = amax(o.args[0]), amax(o.arg(1, "other", 0.0))
    return a + alpha * b, f"{a:.4g} + {alpha * b:.4g}"


@_bound_of(*SUMS)
def _sum(o: _Operands) -> Any:
    x = o.args[0]
    dims = o.arg(1, "dim", None)
    if isinstance(dims, int):
        n = x.shape[dims] if x.dim() else 1
    elif isinstance(dims, (list, tuple)) and dims:
        n = math.prod(x.shape[d] for d in dims)
    else:
        n = x.numel()
    return amax(x) * max(n, 1), f"|x| {amax(x):.4g} x {n} terms"


@_bound_of("pow", "square")
def _power(o: _Operands) -> Any:
    x = o.args[0]
    e = 2.0 if o.base == "square" else o.arg(1, "exponent", None)
    if not isinstance(x, torch.Tensor):
        return None
    if isinstance(e, (int, float)) and e > 0:
        return amax(x) ** float(e), f"|x| {amax(x):.4g} ** {e:g}"
    if isinstance(e, (int, float)) and e < 0:
        small = _amin(x)
        return (small ** float(e) if small > 0 else math.inf), \
            f"the smallest |x| {small:.4g} ** {e:g}"
    if isinstance(e, torch.Tensor):
        return amax(x) ** max(float(e.max()), 0.0), f"|x| {amax(x):.4g} ** {float(e.max()):.4g}"
    return None


@_bound_of("prod", "cumprod")
def _product(o: _Operands) -> Any:
    x = o.args[0]
    bound = amax(x) ** max(x.numel(), 1) if amax(x) > 1 else amax(x)
    return bound, f"|x| {amax(x):.4g} ** {x.numel()}"


@_bound_of("reciprocal")
def _reciprocal(o: _Operands) -> Any:
    small = _amin(o.args[0])
    return (1 / small if small > 0 else math.inf), f"1 / the smallest |x| {small:.4g}"


@_bound_of("div", "true_divide")
def _division(o: _Operands) -> Any:
    den = o.arg(1, "other", 1.0)
    small = abs(float(den)) if isinstance(den, (int, float)) else (
        float(den.detach().abs().double().min()) if den.numel() else 1.0)
    if small > 0:
        return amax(o.args[0]) / small, f"{amax(o.args[0]):.4g} / {small:.4g}"
    return None


@_bound_of(*SQUARES)
def _squares(o: _Operands) -> Any:
    x = o.args[0]
    other = o.args[1] if o.base == "mse_loss" else None
    m = amax(x) + amax(other)
    n = _squared_count(o, x)
    return m * m * max(n, 1), f"({m:.4g})² summed over {n} values"


def _squared_count(o: _Operands, x: torch.Tensor) -> int:
    """How many squares one output element sums: a norm normalizes over its own dimensions
    (layer norm over `normalized_shape`, group norm over a group, batch norm over all but the
    channels), a variance or vector norm over its `dim`; only mse_loss sums them all."""
    if o.base in ("native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"):
        return math.prod(o.arg(1, "normalized_shape", x.shape))
    if o.base == "native_group_norm":
        groups = max(int(o.arg(6, "group", 1)), 1)
        return int(o.arg(4, "C", 1)) // groups * int(o.arg(5, "HxW", 1))
    if o.base.startswith(("native_batch_norm", "_native_batch_norm")):
        return x.numel() // x.shape[1] if x.dim() > 1 and x.shape[1] else x.numel()
    if o.base == "mse_loss" and o.arg(2, "reduction", 1) == 0:    # Reduction::None: each alone
        return 1
    dims = o.arg(2, "dim", None) if o.base in ("linalg_vector_norm", "norm") else \
        o.arg(1, "dim", None) if o.base != "mse_loss" else None
    if isinstance(dims, int):
        dims = [dims]
    if isinstance(dims, (list, tuple)) and dims and x.dim():
        return math.prod(x.shape[d] for d in dims)
    return x.numel()


@_bound_of(*CASTS)
def _cast(o: _Operands) -> Any:
    source = dtype_name(o.floats[0].dtype) if o.floats else "value"
    return o.largest, f"a {source} of {o.largest:.4g} cast to {dtype_name(o.dtype)}"


@_bound_of(*ATTENTIONS)
def _attention(o: _Operands) -> Any:
    q, k = o.args[0], o.args[1]
    d = q.shape[-1]
    return amax(q) * amax(k) * d, f"q·k: |q| {amax(q):.4g} x |k| {amax(k):.4g} x {d} terms"


@_bound_of(*BOUNDED)
def _bounded(o: _Operands) -> Any:
    scale = 2.0 if o.base in ("native_dropout", "dropout") else 1.0
    return o.largest * scale, f"|input| {o.largest:.4g}"


def overflow_bound(op: str, args: tuple, kwargs: dict,
                   out_dtype: torch.dtype | None) -> Bound | None:
    """The op's largest possible |result| given its inputs' magnitudes; None if unknown."""
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point()]
    dtype = out_dtype or (floats[0].dtype if floats else torch.float32)
    if not dtype.is_floating_point:
        return None
    largest = max((amax(t) for t in floats), default=0.0)
    formula = FORMULAS.get(op_base(op))
    found = formula(_Operands(op_base(op), args, kwargs, floats, dtype, largest)) \
        if formula is not None else None
    if found is None:
        return None
    bound, how = found
    return Bound(bound, largest, torch.finfo(dtype).max, dtype, how)
