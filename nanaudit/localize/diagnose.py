"""Name the cause of a finding from the creating op and its inputs, with the real numbers.

Rules follow from the op's mathematics and what its inputs hold (min <= 0 at a log, zeros at a
sqrt's backward, an argument on a pole of lgamma, a result that can exceed the dtype's range),
never from the test programs. One registry, keyed on the aten overload packet, says which ops
have a rule; the tracer keeps the forward inputs of exactly those ops (plus the producers an
explanation names), so the two cannot disagree. For a backward op the subject is its forward op:
SqrtBackward's division by zero is explained by the zeros sqrt saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from nanaudit.localize.causes import fix_for
from nanaudit.localize.stats import first_index

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)


class Reason(NamedTuple):
    """What a rule found: the cause, the explanation, a fix when the catalogue's is too generic,
    and the operand that hit the edge (so the localizer can say where that value came from)."""

    cause: str
    text: str
    fix: str | None = None
    operand: Any = None
    mask: Any = None


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    explanation: str
    fix: str
    operand: Any = None           # the input that hit the edge, for "where it came from"
    mask: Any = None


# --- the op registry -------------------------------------------------------------------------

RULES: dict = {}          # OpOverloadPacket -> rule(base, args, kwargs, phase) -> Reason | None
PRODUCERS: set = set()    # ops an explanation names as the source of a value (softplus -> 0)


def _packets(names):
    for name in names:
        for variant in (name, f"{name}_"):       # the in-place variant shares the rule
            try:
                yield getattr(aten, variant)
            except (AttributeError, RuntimeError):
                continue


def domain_rule(*names: str) -> Callable:
    """Register a rule for aten ops by name; an op registered twice is an error."""
    def register(rule):
        for packet in _packets(names):
            if packet in RULES:
                raise ValueError(f"{packet} has two domain rules ({RULES[packet].__name__}, "
                                 f"{rule.__name__})")
            RULES[packet] = rule
        return rule
    return register


def packet_of(func):
    return getattr(func, "overloadpacket", None)


def keeps_inputs(func) -> bool:
    """Does the tracer keep this forward op's inputs? Exactly the ops a rule or text reads."""
    packet = packet_of(func)
    return packet in RULES or packet in PRODUCERS


def op_base(op_name: str) -> str:
    """`aten.log_.default` -> `log` (in-place folded in); `aten._softmax.default` -> `_softmax`."""
    parts = op_name.split(".")
    base = parts[1] if len(parts) > 1 else parts[0]
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return base


# Ops whose Python-number arguments are values written or computed with (not parameters such
# as `norm(p=inf)` or `nan_to_num(posinf=...)`): a non-finite one there is a source of infinity.
VALUE_SCALAR_OPS = frozenset({
    "full", "full_like", "new_full", "fill", "masked_fill", "index_fill", "where",
    "scalar_tensor", "constant_pad_nd", "index_put", "scatter", "fill_diagonal",
    "add", "sub", "rsub", "mul", "div", "true_divide", "pow", "float_power", "addcmul", "lerp",
    "maximum", "minimum", "fmax", "fmin",
})


def scalar_infinities(args, kwargs, op: str | None = None) -> list:
    """Non-finite Python numbers among an op's value arguments (`float('-inf')` given to
    masked_fill); parameters such as `norm(p=inf)` are not values."""
    if op is not None and op_base(op) not in VALUE_SCALAR_OPS:
        return []
    found = []
    for value in list(args or ()) + list((kwargs or {}).values()):
        values = value if isinstance(value, (list, tuple)) else (value,)
        found += [v for v in values if isinstance(v, float) and not math.isfinite(v)]
    return found


def scalar_overflows(args, kwargs, op: str | None = None) -> list:
    """Finite Python numbers among an op's value arguments that the op's floating dtype cannot
    hold (a statistic computed on the host through `.item()`): inf once the op casts them."""
    if op is not None and op_base(op) not in VALUE_SCALAR_OPS:
        return []
    values = list(args or ()) + list((kwargs or {}).values())
    floats = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not floats:
        return []
    limit = torch.finfo(floats[0].dtype).max
    return [v for v in values if isinstance(v, float) and math.isfinite(v) and abs(v) > limit]


# --- helpers ---------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _where(mask: torch.Tensor) -> str:
    index = first_index(mask)
    if index is None:
        return ""
    return f", first at index {list(index)}" if len(index) > 1 else f", first at index {index[0]}"


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def exp_limit(dtype: torch.dtype) -> float:
    return math.log(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf


def signed(kinds) -> str:
    """'-inf', '+inf', '+-inf' or 'nan' for a set of kinds, for explanations."""
    kinds = set(kinds)
    if "nan" in kinds:
        return "NaN"
    if kinds >= {"inf", "-inf"}:
        return "+-inf"
    return "-inf" if "-inf" in kinds else "+inf"


# --- domain rules ----------------------------------------------------------------------------

LOG_BOUNDS = {"log": 0.0, "log2": 0.0, "log10": 0.0, "log1p": -1.0}


@domain_rule("log", "log2", "log10", "log1p", "xlogy")
def _log_rule(base, args, kwargs, phase):
    if base == "xlogy":
        y = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if y is not None and _count(y < 0):
            return Reason("log-domain", f"xlogy received y < 0 at {_count(y < 0)} position(s)"
                                        f"{_where(y < 0)}; min {_fmt(float(y.min()))}")
        return None
    x = args[0].detach()
    bound = LOG_BOUNDS[base]
    bad = x <= bound
    if not _count(bad):
        return None
    word = "<= -1" if bound < 0 else "<= 0"
    edge = (x == bound) & bad
    made = (f"; {base} of exactly {int(bound)} is -inf" if _count(edge) else "")
    return Reason("log-domain", f"{base} received {_count(bad)} of {x.numel()} value(s) {word}"
                                f"{_where(bad)} (min {_fmt(float(x.min()))}); {base} is defined "
                                f"only for x > {int(bound)}{made}", operand=args[0], mask=bad)


NEGATIVE_BASE_FIX = ("a fractional power of a negative base is NaN: for a signed root use "
                     "`torch.sign(x) * x.abs() ** p`; for a power mean (GeM pooling) clamp the "
                     "base first, `x.clamp(min=eps) ** p`")


@domain_rule("sqrt", "rsqrt")
def _sqrt_rule(base, args, kwargs, phase):
    x = args[0].detach()
    if _count(x < 0):
        return Reason("sqrt-domain", f"{base} received {_count(x < 0)} negative value(s)"
                                     f"{_where(x < 0)} (min {_fmt(float(x.min()))})",
                      operand=args[0], mask=x < 0)
    if _count(x == 0):
        zeros = f"{base} received exact zeros at {_count(x == 0)} of {x.numel()} position(s)" \
                f"{_where(x == 0)}"
        if base == "rsqrt" and phase == "forward":
            return Reason("sqrt-domain", f"{zeros}; rsqrt(0) = 1/sqrt(0) is inf",
                          operand=args[0], mask=x == 0)
        deriv = "1/(2*sqrt(x))" if base == "sqrt" else "-1/(2*x^1.5)"
        when = "its backward" if phase == "backward" else base
        return Reason("sqrt-domain", f"{zeros}; {base}(0) is finite but the derivative {deriv} "
                                     f"is infinite at 0, so {when} made a non-finite value",
                      operand=args[0], mask=x == 0)
    return None


def _exponent(args, kwargs):
    return args[1] if len(args) > 1 else kwargs.get("exponent")


@domain_rule("pow", "float_power")
def _pow_rule(base, args, kwargs, phase):
    x, exponent = args[0], _exponent(args, kwargs)
    if not isinstance(x, torch.Tensor):                # pow.Scalar: number ** tensor, like exp
        return _scalar_base_rule(x, exponent)
    if not x.is_floating_point():
        return None
    x = x.detach()
    if isinstance(exponent, torch.Tensor):
        e = exponent.detach()
        frac = bool((e != e.round()).any())
        negative_e = bool((e < 0).any())
        shown = _fmt(float(e)) if e.numel() == 1 else f"in [{_fmt(float(e.min()))}, " \
                                                       f"{_fmt(float(e.max()))}]"
    elif isinstance(exponent, (int, float)):
        frac = float(exponent) != int(exponent)
        negative_e = exponent < 0
        shown = _fmt(float(exponent))
    else:
        return None
    negative = x < 0
    if frac and _count(negative):
        return Reason("sqrt-domain", f"pow received a negative base at {_count(negative)} "
                                     f"position(s){_where(negative)} (min "
                                     f"{_fmt(float(x.min()))}) with the fractional exponent "
                                     f"{shown}: a real power of a negative number is NaN",
                      fix=NEGATIVE_BASE_FIX, operand=args[0], mask=negative)
    zero = x == 0
    if negative_e and _count(zero):
        return Reason("pole", f"pow received exact zeros at {_count(zero)} of {x.numel()} "
                              f"position(s){_where(zero)} with the negative exponent {shown}: "
                              f"x ** {shown} has a pole at 0 (0 ** {shown} = inf)",
                      operand=args[0], mask=zero)
    small = isinstance(exponent, (int, float)) and 0 < float(exponent) < 1
    if phase == "backward" and small and _count(zero):
        return Reason("sqrt-domain", f"pow(x, {exponent}) received exact zeros at "
                                     f"{_count(zero)} position(s){_where(zero)}; its derivative "
                                     f"{exponent} * x^{float(exponent) - 1:g} is infinite at 0",
                      operand=args[0], mask=zero)
    return None


def _scalar_base_rule(base_value, exponent):
    if not isinstance(exponent, torch.Tensor) or not isinstance(base_value, (int, float)) \
            or abs(base_value) <= 1:
        return None
    e = exponent.detach()
    limit = math.log(torch.finfo(e.dtype).max) / math.log(abs(base_value))
    bad = e > limit
    if not _count(bad):
        return None
    return Reason("exp-overflow", f"{_fmt(base_value)} ** x received x = "
                                  f"{_fmt(float(e.max()))}{_where(bad)}; in {dtype_name(e.dtype)} "
                                  f"it overflows above x = {limit:.1f}")


@domain_rule("exp", "exp2", "expm1", "cosh", "sinh", "special_i0", "i0", "special_i1",
             "special_erfcx")
def _exp_rule(base, args, kwargs, phase):
    x = args[0].detach()
    limit = exp_limit(x.dtype)
    if base == "exp2":
        limit = limit / math.log(2)
    if base == "special_erfcx":                  # erfcx(x) ~ exp(x^2) for x -> -inf
        magnitude, limit = -x, math.sqrt(limit)
    elif base in ("cosh", "sinh"):
        magnitude = x.abs()
    elif base in ("i0", "special_i0", "special_i1"):   # I(x) ~ exp(x) / sqrt(2 pi x)
        magnitude = x.abs()
        limit = limit + math.log(2 * math.pi * limit) / 2
    else:
        magnitude = x
    bad = magnitude > limit
    if not _count(bad):
        return None
    return Reason("exp-overflow", f"{base} received {_fmt(float(magnitude.max()))}{_where(bad)}; "
                                  f"{dtype_name(x.dtype)} {base} overflows above {limit:.1f} "
                                  f"({_count(bad)} of {x.numel()} value(s) above it)")


def _on_integer_pole(x: torch.Tensor) -> torch.Tensor:
    return (x <= 0) & (x == x.round())


@domain_rule("lgamma", "digamma", "polygamma", "mvlgamma", "special_zeta", "tan")
def _pole_rule(base, args, kwargs, phase):
    operand = args[1] if base == "polygamma" else args[0]
    if not isinstance(operand, torch.Tensor):
        return None
    x = operand.detach()
    if base == "tan":
        on = torch.cos(x.double()).abs() < 4 * torch.finfo(x.dtype).eps
        what = "tan has poles at pi/2 + k*pi"
    elif base == "special_zeta":
        on = x == 1
        what = "zeta(x, q) has a pole at x = 1"
    elif base == "mvlgamma":
        p = args[1] if len(args) > 1 else kwargs.get("p", 1)
        on = _on_integer_pole(x - (int(p) - 1) / 2)
        what = f"mvlgamma(x, {p}) has poles at x <= {(int(p) - 1) / 2:g} on a half-integer grid"
    else:
        on = _on_integer_pole(x)
        what = f"{base} has poles at 0 and the negative integers"
    if not _count(on):
        return None
    value = _fmt(float(x[on].flatten()[0]))
    return Reason("pole", f"{base} received {_count(on)} of {x.numel()} value(s) exactly on a "
                          f"pole{_where(on)} (e.g. {value}): {what}, so {base}({value}) is "
                          f"infinite", operand=operand, mask=on)


@domain_rule("acos", "asin", "atanh", "atan2")
def _trig_rule(base, args, kwargs, phase):
    if base == "atan2":
        y, x = args[0].detach(), args[1].detach()
        both = (y == 0) & (x == 0)
        if _count(both):
            return Reason("trig-domain", f"atan2 received (0, 0) at {_count(both)} position(s)"
                                         f"{_where(both)}; its derivative x/(x²+y²) is 0/0 there")
        return None
    x = args[0].detach()
    outside = x.abs() > 1
    if _count(outside):
        return Reason("trig-domain", f"{base} received {_count(outside)} value(s) outside "
                                     f"[-1, 1]{_where(outside)} (min {_fmt(float(x.min()))}, "
                                     f"max {_fmt(float(x.max()))})", operand=args[0],
                      mask=outside)
    edge = x.abs() == 1
    if _count(edge):
        slope = "1/(1-x²)" if base == "atanh" else "1/sqrt(1-x²)"
        return Reason("trig-domain", f"{base} received exactly ±1 at {_count(edge)} position(s)"
                                     f"{_where(edge)}; the derivative {slope} is infinite there",
                      operand=args[0], mask=edge)
    return None


NORM_OPS = {"linalg_vector_norm", "norm", "frobenius_norm", "dist"}
DISTANCE_OPS = {"cdist", "_cdist_forward", "_euclidean_dist"}


@domain_rule(*NORM_OPS, *DISTANCE_OPS)
def _norm_rule(base, args, kwargs, phase):
    x = args[0].detach()
    if base in DISTANCE_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        d = torch.cdist(x.double(), args[1].detach().double())
        zero = d == 0
        if _count(zero):
            return Reason("norm-at-zero", f"{base} received identical points at {_count(zero)} "
                                          f"pair(s){_where(zero)}: a zero distance, whose "
                                          f"gradient is 0/0")
        return None
    dim = args[2] if base == "linalg_vector_norm" and len(args) > 2 else kwargs.get("dim")
    norms = torch.linalg.vector_norm(x.double(), dim=dim)
    zero = norms == 0
    if _count(zero):
        return Reason("norm-at-zero", f"{base} received {_count(zero)} all-zero vector(s)"
                                      f"{_where(zero)}: the norm is 0 and its gradient x/|x| is "
                                      f"0/0")
    return None


@domain_rule("_softmax", "_log_softmax", "softmax", "log_softmax", "logsumexp")
def _masked_row_rule(base, args, kwargs, phase):
    """A row of nothing but -inf: softmax is 0/0 = NaN, logsumexp is log(0) = -inf."""
    x = args[0].detach()
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    rows = (x == -math.inf).all(dim=dim)
    if not _count(rows):
        return None
    result = ("the log of an empty sum, -inf" if base == "logsumexp"
              else "every exp is 0 and 0/0 = NaN")
    return Reason("softmax-all-masked", f"{base.lstrip('_')} received {_count(rows)} row(s) "
                                        f"whose entries are all -inf{_where(rows)} (a fully "
                                        f"masked or empty sequence): {result}")


DIV_OPS = ("div", "true_divide", "reciprocal", "remainder", "fmod", "floor_divide")


@domain_rule(*DIV_OPS)
def _div_rule(base, args, kwargs, phase):
    if base == "reciprocal":
        num, den = None, args[0]
    else:
        num = args[0] if isinstance(args[0], torch.Tensor) else None
        den = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(den, (int, float)):
        return Reason("div-by-zero", f"{base} by the constant 0") if den == 0 else None
    if not isinstance(den, torch.Tensor):
        return None
    operand, den = den, den.detach()
    if num is not None and bool(torch.isinf(num).any()) and bool(torch.isinf(den).any()):
        return Reason("inf-arithmetic",
                      f"{base} received infinities in both numerator and denominator")
    zero = den == 0
    if not _count(zero):
        return None
    detail = ""
    if num is not None and num.shape == den.shape:
        zz = _count(zero & (num.detach() == 0))
        detail = f"; {zz} of them over a zero numerator (0/0 = NaN)" if zz else ""
    return Reason("div-by-zero", f"the denominator of {base} holds {_count(zero)} zero(s) of "
                                 f"{den.numel()}{_where(zero)}{detail}", operand=operand,
                  mask=zero)


@domain_rule("std", "var", "std_mean", "var_mean")
def _var_rule(base, args, kwargs, phase):
    x = args[0].detach()
    dims = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], bool) else None)
    if dims is None:
        n = x.numel()
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        n = math.prod(x.shape[d] for d in dims) if dims else x.numel()
    correction = kwargs.get("correction")
    correction = 1 if correction is None else float(correction)
    if n - correction > 0:
        return None
    return Reason("degenerate-reduction", f"{base} reduced over {n} element(s) with correction="
                                          f"{correction:g}: {n - correction:g} degrees of freedom")


@domain_rule("mean")
def _mean_rule(base, args, kwargs, phase):
    x = args[0]
    if isinstance(x, torch.Tensor) and x.numel() == 0:
        return Reason("degenerate-reduction", f"{base} of an empty tensor of shape "
                                              f"{tuple(x.shape)}")
    return None


@domain_rule("nll_loss_forward", "nll_loss2d_forward")
def _nll_rule(base, args, kwargs, phase):
    target = args[1].detach()
    ignore_index = args[4] if len(args) > 4 else -100
    weight = args[2] if len(args) > 2 else None
    valid = target != ignore_index
    if _count(valid) == 0:
        return Reason("degenerate-reduction", f"every one of the {target.numel()} target(s) "
                                              f"equals ignore_index={ignore_index}: the mean "
                                              f"over zero targets is 0/0 = NaN")
    if isinstance(weight, torch.Tensor) and float(weight[target[valid]].sum()) == 0:
        return Reason("degenerate-reduction", "the class weights of every valid target are 0: "
                                              "0/0")
    return None


@domain_rule("_ctc_loss", "ctc_loss")
def _ctc_rule(base, args, kwargs, phase):
    targets, in_lens, tgt_lens = args[1], args[2], args[3]
    in_lens = torch.as_tensor(in_lens).tolist()
    tgt_lens = torch.as_tensor(tgt_lens).tolist()
    targets = targets.detach().cpu()
    bad = []
    offset = 0
    for b, (il, tl) in enumerate(zip(in_lens, tgt_lens)):
        row = targets[b, :tl] if targets.dim() == 2 else targets[offset:offset + tl]
        offset += tl
        repeats = int((row[1:] == row[:-1]).sum()) if tl > 1 else 0
        if tl + repeats > il:
            bad.append(f"sample {b}: target length {tl} + {repeats} repeat(s) > input length {il}")
    if not bad:
        return None
    return Reason("impossible-ctc-target", "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)"
                                                                 if len(bad) > 5 else ""))


# Ops an explanation names as the source of a value that sits on an edge: their inputs are kept
# so the text can say "softplus of -180 underflows to exactly 0".
PRODUCERS.update(_packets(("softplus", "sigmoid", "exp", "exp2", "log_sigmoid")))
# Ops whose backward can create a non-finite value from finite inputs without a forward rule:
# their inputs are kept so the statistics of the forward op appear in the report.
PRODUCERS.update(_packets(("tanh", "acosh", "binary_cross_entropy", "prod", "cumprod",
                           "linalg_svd", "_linalg_svd", "_linalg_eigh")))


def domain_reason(func_or_op, args, kwargs, phase: str) -> Reason | None:
    """The catalogue cause an op's inputs explain, with the numbers; None when none applies."""
    if args is None:
        return None
    if isinstance(func_or_op, str):
        base = op_base(func_or_op)
        rule = next((r for p, r in RULES.items() if op_base(str(p)) == base), None)
    else:
        base = op_base(str(func_or_op))
        rule = RULES.get(packet_of(func_or_op))
    if rule is None:
        return None
    try:
        return rule(base, tuple(args), dict(kwargs or {}), phase)
    except (IndexError, TypeError, RuntimeError, ValueError, AttributeError):
        return None  # an overload with another argument layout: fall through


# --- can the result overflow? ----------------------------------------------------------------

@dataclass(frozen=True)
class Bound:
    """The largest finite result an op can give from its inputs' magnitudes, against the range."""

    bound: float
    largest_input: float
    limit: float
    dtype: torch.dtype
    how: str                     # the formula, for the explanation


def _amax(t) -> float:
    if isinstance(t, (int, float)):
        return abs(float(t))
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) \
            or t.numel() == 0:
        return 0.0
    return float(t.detach().abs().double().nan_to_num(0, 0, 0).max())


def _amin(t) -> float:
    if not isinstance(t, torch.Tensor) or not t.numel():
        return 0.0
    return float(t.detach().abs().double().nan_to_num(0, 0, 0).min())


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _product_bound(a, b, k):
    return _amax(a) * _amax(b) * k


MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "dot": (0, 1), "mv": (0, 1),
           "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2),
           "linear": (0, 1)}
CONVOLUTIONS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
                "mkldnn_convolution", "_slow_conv2d_forward", "convolution_backward"}
SUMS = {"sum", "nansum", "cumsum", "mean", "logcumsumexp"}
SQUARES = {"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm",
           "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
           "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "mse_loss"}
CASTS = {"_to_copy", "to", "copy", "_copy_from", "clone", "type_as"}
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


def overflow_bound(op: str, args, kwargs, out_dtype: torch.dtype | None) -> Bound | None:
    """The op's largest possible |result| given its inputs' magnitudes; None if unknown."""
    base = op_base(op)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point()]
    dtype = out_dtype or (floats[0].dtype if floats else torch.float32)
    if not dtype.is_floating_point:
        return None
    limit = torch.finfo(dtype).max
    largest = max((_amax(t) for t in floats), default=0.0)
    bound, how = None, ""
    if base in MATMULS:
        i, j = MATMULS[base]
        a, b = args[i], args[j]
        k = a.shape[-1] if a.dim() else 1
        bound = _product_bound(a, b, k)
        how = f"|A| {_amax(a):.4g} x |B| {_amax(b):.4g} x {k} terms"
        if i == 1:
            beta = abs(float(kwargs.get("beta", 1)))
            alpha = abs(float(kwargs.get("alpha", 1)))
            bound = bound * alpha + beta * _amax(args[0])
            how += f" + |bias| {_amax(args[0]):.4g}"
    elif base in CONVOLUTIONS and base != "convolution_backward":
        x, w = args[0], args[1]
        k = w[0].numel() if w.dim() else 1
        bias = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
        bound = _product_bound(x, w, k) + _amax(bias)
        how = f"|x| {_amax(x):.4g} x |w| {_amax(w):.4g} x {k} terms"
    elif base in ("mul", "addcmul", "addcdiv"):
        if base == "mul":
            bound = _amax(args[0]) * _amax(_arg(args, kwargs, 1, "other", 1.0))
            how = f"{_amax(args[0]):.4g} x {_amax(_arg(args, kwargs, 1, 'other', 1.0)):.4g}"
        elif base == "addcmul":
            bound = _amax(args[0]) + abs(float(kwargs.get("value", 1))) * _amax(args[1]) * \
                _amax(args[2])
            how = "|input| + |value| x |t1| x |t2|"
    elif base in ("add", "sub", "rsub"):
        alpha = abs(float(kwargs.get("alpha", 1)))
        a, b = _amax(args[0]), _amax(_arg(args, kwargs, 1, "other", 0.0))
        bound, how = a + alpha * b, f"{a:.4g} + {alpha * b:.4g}"
    elif base in SUMS:
        x = args[0]
        dims = _arg(args, kwargs, 1, "dim", None)
        if isinstance(dims, int):
            n = x.shape[dims] if x.dim() else 1
        elif isinstance(dims, (list, tuple)) and dims:
            n = math.prod(x.shape[d] for d in dims)
        else:
            n = x.numel()
        bound, how = _amax(x) * max(n, 1), f"|x| {_amax(x):.4g} x {n} terms"
    elif base in ("pow", "square"):
        e = 2.0 if base == "square" else _arg(args, kwargs, 1, "exponent", None)
        if isinstance(e, (int, float)) and isinstance(args[0], torch.Tensor) and e > 0:
            bound, how = _amax(args[0]) ** float(e), f"|x| {_amax(args[0]):.4g} ** {e:g}"
        elif isinstance(e, (int, float)) and isinstance(args[0], torch.Tensor) and e < 0:
            small = _amin(args[0])
            bound = small ** float(e) if small > 0 else math.inf
            how = f"the smallest |x| {small:.4g} ** {e:g}"
        elif isinstance(e, torch.Tensor) and isinstance(args[0], torch.Tensor):
            bound = _amax(args[0]) ** max(float(e.max()), 0.0)
            how = f"|x| {_amax(args[0]):.4g} ** {float(e.max()):.4g}"
    elif base in ("prod", "cumprod"):
        x = args[0]
        bound = _amax(x) ** max(x.numel(), 1) if _amax(x) > 1 else _amax(x)
        how = f"|x| {_amax(x):.4g} ** {x.numel()}"
    elif base == "reciprocal":
        small = _amin(args[0])
        bound = 1 / small if small > 0 else math.inf
        how = f"1 / the smallest |x| {small:.4g}"
    elif base in ("div", "true_divide"):
        den = _arg(args, kwargs, 1, "other", 1.0)
        small = abs(float(den)) if isinstance(den, (int, float)) else (
            float(den.detach().abs().double().min()) if den.numel() else 1.0)
        if small > 0:
            bound, how = _amax(args[0]) / small, f"{_amax(args[0]):.4g} / {small:.4g}"
    elif base in SQUARES:
        x = args[0]
        other = args[1] if base == "mse_loss" else None
        m = _amax(x) + _amax(other)
        bound, how = m * m * max(x.numel(), 1), f"({m:.4g})² summed over {x.numel()} values"
    elif base in CASTS:
        bound, how = largest, f"a {dtype_name(floats[0].dtype) if floats else 'value'} of " \
                              f"{largest:.4g} cast to {dtype_name(dtype)}"
    elif base in ("_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "scaled_dot_product_attention", "_scaled_dot_product_attention_math"):
        q, k = args[0], args[1]
        d = q.shape[-1]
        bound = _amax(q) * _amax(k) * d
        how = f"q·k: |q| {_amax(q):.4g} x |k| {_amax(k):.4g} x {d} terms"
    elif base in BOUNDED:
        scale = 2.0 if base in ("native_dropout", "dropout") else 1.0
        bound, how = largest * scale, f"|input| {largest:.4g}"
    if bound is None:
        return None
    return Bound(bound, largest, limit, dtype, how)


# --- growth on the timeline --------------------------------------------------------------------

def growth_before(timeline, min_steps: int = 3, min_factor: float = 10.0):
    """(metric, first step of the growth, factor) when loss or grad norm grew geometrically."""
    for metric in ("grad_norm", "loss"):
        values = [(e.step, getattr(e, metric)) for e in timeline
                  if getattr(e, metric) is not None and math.isfinite(getattr(e, metric))]
        run = 0
        for i in range(len(values) - 1, 0, -1):
            if abs(values[i][1]) > abs(values[i - 1][1]):
                run += 1
            else:
                break
        if run >= min_steps:
            first = values[len(values) - 1 - run]
            last = values[-1]
            factor = abs(last[1]) / max(abs(first[1]), 1e-30)
            if factor >= min_factor:
                return metric, first[0], factor
    return None


# --- the diagnosis of one creating op ---------------------------------------------------------

def _out_dtype(event) -> torch.dtype | None:
    dtype = (event.kwargs or {}).get("dtype") if event.args is not None else None
    if isinstance(dtype, torch.dtype):
        return dtype
    return None


def infinity_reason(event, timeline) -> Reason | None:
    """Why an op made +-inf from finite inputs: a domain rule, else a real overflow (only when
    the result can exceed the range given the inputs), else None."""
    subject = event.forward if event.phase == "backward" and event.forward is not None \
        and event.forward.args is not None else None
    if subject is not None:
        reason = domain_reason(subject.func or subject.op, subject.args, subject.kwargs,
                               event.phase)
        if reason is not None:
            return reason
    reason = domain_reason(event.func or event.op, event.args, event.kwargs, event.phase)
    if reason is not None:
        return reason
    return overflow_reason(event, timeline)


def _dst_dtype(event) -> torch.dtype | None:
    """The dtype an op wrote: the cast's target, else the first floating input's."""
    dtype = _out_dtype(event)
    if dtype is not None:
        return dtype
    if op_base(event.op) in ("copy", "_copy_from") and event.args:
        target = event.args[0] if op_base(event.op) == "copy" else event.args[1]
        return target.dtype if isinstance(target, torch.Tensor) else None
    return None


def overflow_reason(event, timeline) -> Reason:
    base = op_base(event.op)
    bound = overflow_bound(event.op, event.args, event.kwargs, _dst_dtype(event))
    made = signed(event.out_kinds - {"nan"}) if event.out_kinds - {"nan"} else "NaN"
    if bound is None:
        return _no_bound(event, base, made)
    name = dtype_name(bound.dtype)
    numbers = (f"the largest |input| was {bound.largest_input:.4g}, {name} max is "
               f"{bound.limit:.6g}")
    if bound.bound < bound.limit:
        return Reason("unknown", f"{base} made {made} from finite inputs, but its result cannot "
                                 f"exceed {bound.bound:.4g} ({bound.how}): {numbers}, so this is "
                                 f"not an overflow of these values")
    growth = growth_before(timeline)
    if bound.dtype not in LOW_PRECISION and growth:
        metric, start, factor = growth
        return Reason("divergence", f"{base} overflowed {name} from finite inputs: {numbers} "
                                    f"({bound.how} can reach {bound.bound:.4g}); the "
                                    f"{metric.replace('_', ' ')} grew {factor:.3g}x from step "
                                    f"{start} before this step")
    return Reason("dtype-overflow", f"{base} produced {made} from finite inputs: {numbers}; "
                                    f"{bound.how} can reach {bound.bound:.4g}, and {name} holds "
                                    f"at most {bound.limit:.6g}")


def _no_bound(event, base, made) -> Reason:
    tensors = [a for a in list(event.args or ()) + list((event.kwargs or {}).values())
               if isinstance(a, torch.Tensor) and a.is_floating_point()]
    largest = max((_amax(t) for t in tensors), default=0.0)
    dtype = _dst_dtype(event) or (tensors[0].dtype if tensors else torch.float32)
    limit = torch.finfo(dtype).max
    numbers = f"the largest |input| was {largest:.4g}, {dtype_name(dtype)} max is {limit:.6g}"
    if largest >= limit * 1e-3:
        return Reason("dtype-overflow", f"{base} produced {made} from finite inputs near the top "
                                        f"of the range: {numbers}")
    return Reason("unknown", f"{base} made {made} from finite inputs ({numbers}); these "
                             f"magnitudes do not overflow and no rule for {base} explains it")


def diagnose(event, kind: str, timeline) -> Diagnosis:
    """The cause of a value of `kind` ('nan' or 'inf') created by `event` from its own inputs
    (the localizer has already followed any infinity it received back to its maker)."""
    forward = event.forward
    subject = (forward.func or forward.op, forward.args, forward.kwargs) \
        if event.phase == "backward" and forward is not None else None
    reason = domain_reason(*subject, event.phase) if subject else None
    if reason is None:
        reason = domain_reason(event.func or event.op, event.args, event.kwargs, event.phase)
    if reason is not None:
        text = reason.text
        if event.phase == "backward" and subject:
            text += f" (backward of {op_base(forward.op)} computed {op_base(event.op)})"
        return Diagnosis(reason.cause, text, reason.fix or fix_for(reason.cause), reason.operand,
                         reason.mask)
    infinite = any(k & {"inf", "-inf"} for k in event.in_kinds) or \
        bool(scalar_infinities(event.args, event.kwargs, event.op))
    if kind == "inf" and not infinite and not any("nan" in k for k in event.in_kinds):
        return as_diagnosis(overflow_reason(event, timeline))
    if kind == "nan" and infinite:
        text = (f"{op_base(event.op)} combined infinite inputs into NaN (inf - inf, 0 * inf or "
                f"inf / inf)")
        return Diagnosis("inf-arithmetic", text, fix_for("inf-arithmetic"))
    if kind == "nan" and not infinite and not any(event.in_kinds):
        found = overflow_reason(event, timeline)
        if found.cause != "unknown":       # partial results overflowed to +inf and -inf and met
            return as_diagnosis(found, found.text.replace(
                "produced nan", "produced NaN").replace(
                "from finite inputs", "from finite inputs (its partial results overflowed to "
                                      "+inf and -inf, and inf - inf = NaN)", 1))
    held = sorted(set().union(*event.in_kinds)) if event.in_kinds else []
    inputs = (f"inputs that already held {', '.join(held)}" if held
              else "inputs that were all finite")
    text = f"{op_base(event.op)} made {kind} from {inputs}"
    return Diagnosis("unknown", text, fix_for("unknown"))


def as_diagnosis(reason: Reason, text: str | None = None) -> Diagnosis:
    return Diagnosis(reason.cause, reason.text if text is None else text,
                     reason.fix or fix_for(reason.cause), reason.operand, reason.mask)


def masked_gradient(event, forward, reason: Reason | None, origin_text: str | None = None
                    ) -> Diagnosis:
    """A forward value made non-finite by `forward` and masked away; backward made NaN of it."""
    kinds = "/".join(sorted(forward.out_kinds))
    why = f" because {reason.text}" if reason else ""
    if origin_text:
        why = f" because {origin_text}"
    text = (f"in forward, {op_base(forward.op)} produced {kinds}{why}; that value was masked or "
            f"indexed away, so the loss stayed finite, but the backward of "
            f"{op_base(forward.op)} ({op_base(event.op)}) multiplied it by a zero gradient: "
            f"0 * inf = NaN (pytorch issue 4132)")
    fix = fix_for("masked-nonfinite-gradient")
    if reason:
        source_fix = reason.fix or fix_for(reason.cause)
        fix += f"; or remove the {reason.cause} at its source: {source_fix}"
    return Diagnosis("masked-nonfinite-gradient", text, fix)
