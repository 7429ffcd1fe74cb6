"""Name the cause of a finding from the creating op and its inputs, with the real numbers.

Rules follow from the op and what its inputs hold (min <= 0 at a log, zeros at a sqrt's
backward, an all -inf row at a softmax), never from the test programs. For a backward op the
subject is its forward op: SqrtBackward's division by zero is explained by the zeros sqrt saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanaudit.causes import fix_for
from nanaudit.stats import first_index
from nanaudit.tracer import OpEvent, op_base

LOG_OPS = {"log": 0.0, "log2": 0.0, "log10": 0.0, "log1p": -1.0}
EXP_OPS = {"exp", "exp2", "expm1", "cosh", "sinh"}
TRIG_OPS = {"acos", "asin", "atanh"}
NORM_OPS = {"linalg_vector_norm", "norm", "frobenius_norm", "dist"}
DISTANCE_OPS = {"cdist", "_cdist_forward", "_euclidean_dist"}
SOFTMAX_OPS = {"_softmax", "_log_softmax", "softmax", "log_softmax"}
DIV_OPS = {"div", "true_divide", "reciprocal", "remainder", "fmod", "floor_divide"}
VAR_OPS = {"std", "var", "std_mean", "var_mean"}
NLL_OPS = {"nll_loss_forward", "nll_loss2d_forward"}
CTC_OPS = {"_ctc_loss", "ctc_loss"}
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    explanation: str
    fix: str


def _tensors(args) -> list:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _where(mask: torch.Tensor) -> str:
    index = first_index(mask)
    if index is None:
        return ""
    return f", first at index {list(index)}" if len(index) > 1 else f", first at index {index[0]}"


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def exp_limit(dtype: torch.dtype) -> float:
    return math.log(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf


# --- domain rules: (cause, explanation) or None ---------------------------------------------

def _log_rule(base, args, kwargs, phase):
    if base == "xlogy":
        y = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if y is not None and _count(y < 0):
            return "log-domain", f"xlogy received y < 0 at {_count(y < 0)} position(s)" \
                                 f"{_where(y < 0)}; min {_fmt(float(y.min()))}"
        return None
    x = args[0].detach()
    bound = LOG_OPS[base]
    bad = x <= bound
    if not _count(bad):
        return None
    word = "<= -1" if bound < 0 else "<= 0"
    return "log-domain", (f"{base} received {_count(bad)} of {x.numel()} value(s) {word}"
                          f"{_where(bad)} (min {_fmt(float(x.min()))}); {base} is defined only "
                          f"for x > {int(bound)}")


def _sqrt_rule(base, args, kwargs, phase):
    x = args[0].detach()
    if base == "pow":
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        frac = (isinstance(exponent, (int, float)) and float(exponent) != int(exponent)) or \
            (isinstance(exponent, torch.Tensor) and bool((exponent != exponent.round()).any()))
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        if frac and _count(x < 0):
            return "sqrt-domain", (f"pow received a negative base at {_count(x < 0)} "
                                   f"position(s){_where(x < 0)} (min {_fmt(float(x.min()))}) "
                                   f"with a fractional exponent {exponent}")
        small = isinstance(exponent, (int, float)) and 0 < float(exponent) < 1
        if phase == "backward" and small and _count(x == 0):
            return "sqrt-domain", (f"pow(x, {exponent}) received exact zeros at {_count(x == 0)}"
                                   f" position(s){_where(x == 0)}; its derivative "
                                   f"{exponent} * x^{float(exponent) - 1:g} is infinite at 0")
        return None
    if _count(x < 0):
        return "sqrt-domain", (f"{base} received {_count(x < 0)} negative value(s)"
                               f"{_where(x < 0)} (min {_fmt(float(x.min()))})")
    if _count(x == 0):
        deriv = "1/(2*sqrt(x))" if base == "sqrt" else "-1/(2*x^1.5)"
        when = "its backward" if phase == "backward" else base
        return "sqrt-domain", (f"{base} received exact zeros at {_count(x == 0)} of {x.numel()} "
                               f"position(s){_where(x == 0)}; {base}(0) is finite "
                               f"but the derivative {deriv} is infinite at 0, so {when} made "
                               f"a non-finite value")
    return None


def _exp_rule(base, args, kwargs, phase):
    x = args[0].detach()
    limit = exp_limit(x.dtype)
    magnitude = x.abs() if base in ("cosh", "sinh") else x
    bad = magnitude > limit
    if not _count(bad):
        return None
    return "exp-overflow", (f"{base} received {_fmt(float(magnitude.max()))}{_where(bad)}; "
                            f"{str(x.dtype).replace('torch.', '')} {base} overflows above "
                            f"{limit:.1f} ({_count(bad)} of {x.numel()} value(s) above it)")


def _trig_rule(base, args, kwargs, phase):
    if base == "atan2":
        y, x = args[0].detach(), args[1].detach()
        both = (y == 0) & (x == 0)
        if _count(both):
            return "trig-domain", (f"atan2 received (0, 0) at {_count(both)} position(s)"
                                   f"{_where(both)}; its derivative x/(x²+y²) is 0/0 there")
        return None
    x = args[0].detach()
    outside = x.abs() > 1
    if _count(outside):
        return "trig-domain", (f"{base} received {_count(outside)} value(s) outside [-1, 1]"
                               f"{_where(outside)} (min {_fmt(float(x.min()))}, max "
                               f"{_fmt(float(x.max()))})")
    edge = x.abs() == 1
    if _count(edge):
        return "trig-domain", (f"{base} received exactly ±1 at {_count(edge)} position(s)"
                               f"{_where(edge)}; the derivative 1/sqrt(1-x²) is infinite there")
    return None


def _norm_rule(base, args, kwargs, phase):
    x = args[0].detach()
    if base in DISTANCE_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        d = torch.cdist(x.double(), args[1].detach().double())
        zero = d == 0
        if _count(zero):
            return "norm-at-zero", (f"{base} received identical points at {_count(zero)} "
                                    f"pair(s){_where(zero)}: a zero distance, whose gradient "
                                    f"is 0/0")
        return None
    dim = args[2] if base == "linalg_vector_norm" and len(args) > 2 else kwargs.get("dim")
    norms = torch.linalg.vector_norm(x.double(), dim=dim)
    zero = norms == 0
    if _count(zero):
        return "norm-at-zero", (f"{base} received {_count(zero)} all-zero vector(s)"
                                f"{_where(zero)}: the norm is 0 and its gradient x/|x| is 0/0")
    return None


def _softmax_rule(base, args, kwargs, phase):
    x, dim = args[0].detach(), args[1] if len(args) > 1 else kwargs.get("dim", -1)
    rows = (x == -math.inf).all(dim=dim)
    if not _count(rows):
        return None
    return "softmax-all-masked", (f"{base.lstrip('_')} received {_count(rows)} row(s) whose "
                                  f"entries are all -inf{_where(rows)} (a fully masked or empty "
                                  f"sequence): every exp is 0 and 0/0 = NaN")


def _div_rule(base, args, kwargs, phase):
    if base == "reciprocal":
        num, den = None, args[0]
    else:
        num = args[0] if isinstance(args[0], torch.Tensor) else None
        den = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(den, (int, float)):
        return ("div-by-zero", f"{base} by the constant 0") if den == 0 else None
    if not isinstance(den, torch.Tensor):
        return None
    den = den.detach()
    if num is not None and bool(torch.isinf(num).any()) and bool(torch.isinf(den).any()):
        return "inf-arithmetic", f"{base} received infinities in both numerator and denominator"
    zero = den == 0
    if not _count(zero):
        return None
    detail = ""
    if num is not None and num.shape == den.shape:
        zz = _count(zero & (num.detach() == 0))
        detail = f"; {zz} of them over a zero numerator (0/0 = NaN)" if zz else ""
    return "div-by-zero", (f"the denominator of {base} holds {_count(zero)} zero(s) of "
                           f"{den.numel()}{_where(zero)}{detail}")


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
    return "degenerate-reduction", (f"{base} reduced over {n} element(s) with correction="
                                    f"{correction:g}: {n - correction:g} degrees of freedom")


def _mean_rule(base, args, kwargs, phase):
    x = args[0]
    if isinstance(x, torch.Tensor) and x.numel() == 0:
        return "degenerate-reduction", f"{base} of an empty tensor of shape {tuple(x.shape)}"
    return None


def _nll_rule(base, args, kwargs, phase):
    target = args[1].detach()
    ignore_index = args[4] if len(args) > 4 else -100
    weight = args[2] if len(args) > 2 else None
    valid = target != ignore_index
    if _count(valid) == 0:
        return "degenerate-reduction", (f"every one of the {target.numel()} target(s) equals "
                                        f"ignore_index={ignore_index}: the mean over zero "
                                        f"targets is 0/0 = NaN")
    if isinstance(weight, torch.Tensor) and float(weight[target[valid]].sum()) == 0:
        return "degenerate-reduction", "the class weights of every valid target are 0: 0/0"
    return None


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
    return "impossible-ctc-target", "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)"
                                                          if len(bad) > 5 else "")


RULES = [
    (set(LOG_OPS) | {"xlogy"}, _log_rule),
    ({"sqrt", "rsqrt", "pow"}, _sqrt_rule),
    (EXP_OPS, _exp_rule),
    (TRIG_OPS | {"atan2"}, _trig_rule),
    (NORM_OPS | DISTANCE_OPS, _norm_rule),
    (SOFTMAX_OPS, _softmax_rule),
    (DIV_OPS, _div_rule),
    (VAR_OPS, _var_rule),
    ({"mean"}, _mean_rule),
    (NLL_OPS, _nll_rule),
    (CTC_OPS, _ctc_rule),
]


def domain_reason(op: str, args, kwargs, phase: str):
    """The catalogue cause an op's inputs explain, with the numbers; None when none applies."""
    base = op_base(op)
    if args is None:
        return None
    for ops, rule in RULES:
        if base in ops:
            try:
                return rule(base, tuple(args), dict(kwargs or {}), phase)
            except (IndexError, TypeError, RuntimeError, ValueError):
                return None  # an overload with another argument layout: fall through
    return None


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


# --- the diagnosis ---------------------------------------------------------------------------

def _finite_max(tensors) -> float:
    values = [float(t.detach().double().abs().nan_to_num(0, 0, 0).max())
              for t in tensors if t.is_floating_point() and t.numel()]
    return max(values) if values else 0.0


def _overflow(event: OpEvent, timeline) -> Diagnosis:
    tensors = _tensors(event.args or ())
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    limit = torch.finfo(dtype).max
    biggest = _finite_max(tensors)
    base = op_base(event.op)
    growth = growth_before(timeline)
    if dtype not in LOW_PRECISION and growth:
        metric, start, factor = growth
        text = (f"{base} overflowed {str(dtype).replace('torch.', '')} (max {limit:.3g}) from "
                f"finite inputs (largest |input| {biggest:.4g}); the {metric.replace('_', ' ')} "
                f"grew {factor:.3g}x from step {start} before this step")
        return Diagnosis("divergence", text, fix_for("divergence"))
    text = (f"{base} produced inf from finite inputs: the largest |input| is {biggest:.4g} and "
            f"{str(dtype).replace('torch.', '')} holds at most {limit:.6g}")
    return Diagnosis("dtype-overflow", text, fix_for("dtype-overflow"))


def diagnose(event: OpEvent, kind: str, timeline, trace=None) -> Diagnosis:
    """The cause of a value of `kind` ('nan' or 'inf') created by `event`."""
    forward = event.forward
    if event.phase == "backward" and forward is not None and forward.out_kinds:
        return _masked(event, forward, trace, timeline)
    subject_op, args, kwargs = ((forward.op, forward.args, forward.kwargs)
                                if event.phase == "backward" and forward is not None
                                else (event.op, event.args, event.kwargs))
    reason = domain_reason(subject_op, args, kwargs, event.phase)
    if reason is None and subject_op != event.op:
        reason = domain_reason(event.op, event.args, event.kwargs, event.phase)
    if reason is not None:
        cause, text = reason
        if event.phase == "backward":
            text += f" (backward of {op_base(subject_op)} computed {op_base(event.op)})"
        return Diagnosis(cause, text, fix_for(cause))
    inputs_bad = any(k for k in event.in_kinds)
    if kind == "inf" and not inputs_bad:
        return _overflow(event, timeline)
    if kind == "nan" and any(k & {"inf", "-inf"} for k in event.in_kinds):
        text = (f"{op_base(event.op)} combined infinite inputs into NaN (inf - inf, 0 * inf or "
                f"inf / inf)")
        return Diagnosis("inf-arithmetic", text, fix_for("inf-arithmetic"))
    text = f"{op_base(event.op)} made {kind} from inputs that were all finite"
    return Diagnosis("unknown", text, fix_for("unknown"))


def _masked(event: OpEvent, forward, trace, timeline) -> Diagnosis:
    kinds = "/".join(sorted(forward.out_kinds))
    reason = domain_reason(forward.op, forward.args, forward.kwargs, "forward")
    if trace is not None and forward.event is not None and (reason is None
                                                           or reason[0] == "inf-arithmetic"):
        # The forward value may itself come from further up (exp overflow, then inf / inf).
        from nanaudit.tracer import walk_back
        origin_kind = "nan" if "nan" in forward.out_kinds else "inf"
        origin, _ = walk_back(trace, forward.event, origin_kind)
        if origin.index != forward.event:
            found = diagnose(origin, origin_kind, timeline, trace)
            if found.cause not in ("unknown", "inf-arithmetic"):
                reason = (found.cause, f"{found.explanation}, and {op_base(forward.op)} "
                                       f"turned it into {kinds}")
    why = f" because {reason[1]}" if reason else ""
    text = (f"in forward, {op_base(forward.op)} produced {kinds}{why}; that value was masked or "
            f"indexed away, so the loss stayed finite, but the backward of "
            f"{op_base(forward.op)} ({op_base(event.op)}) multiplied it by a zero gradient: "
            f"0 * inf = NaN (pytorch issue 4132)")
    fix = fix_for("masked-nonfinite-gradient")
    if reason:
        fix += f"; or remove the {reason[0]} at its source: {fix_for(reason[0])}"
    return Diagnosis("masked-nonfinite-gradient", text, fix)
