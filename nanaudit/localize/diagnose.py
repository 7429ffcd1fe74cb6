"""Name the cause of a finding from the creating op and its inputs, with the real numbers.

Rules follow from the op's mathematics and what its inputs hold (min <= 0 at a log, zeros at a
sqrt's backward, an argument on a pole of lgamma, a result that can exceed the dtype's range),
never from the test programs. The domain rules live in `rules/` (one registry, which the tracer
reads too), the overflow bounds in `overflow`; this module picks between them. For a backward
op the subject is its forward op: SqrtBackward's division by zero is explained by the zeros
sqrt saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.causes import fix_for
from nanaudit.localize.events import signed
from nanaudit.localize.ops import dtype_name, op_base, scalar_infinities
from nanaudit.localize.overflow import amax, overflow_bound
from nanaudit.localize.rules.registry import Reason, domain_reason
from nanaudit.localize.weight_growth import WeightHistory, grown_weight
from nanaudit.report.vocabulary import Cause, Where

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    explanation: str
    fix: str
    operand: Any = None           # the input that hit the edge, for "where it came from"
    mask: Any = None


def as_diagnosis(reason: Reason, text: str | None = None) -> Diagnosis:
    return Diagnosis(reason.cause, reason.text if text is None else text,
                     reason.fix or fix_for(reason.cause), reason.operand, reason.mask)


# --- growth on the timeline --------------------------------------------------------------------

def growth_before(timeline: Any, min_steps: int = 3, min_factor: float = 10.0) -> Any:
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


# --- an infinity made from finite inputs ---------------------------------------------------------

def infinity_reason(event: Any, timeline: Any,
                    weights: WeightHistory | None = None) -> Reason | None:
    """Why an op made +-inf from finite inputs: a domain rule, else a real overflow (only when
    the result can exceed the range given the inputs), else None. `weights`: who updated the
    parameters the op read (weight_growth.py)."""
    subject = event.forward if event.phase == Where.BACKWARD and event.forward is not None \
        and event.forward.args is not None else None
    if subject is not None:
        reason = domain_reason(subject.func or subject.op, subject.args, subject.kwargs,
                               event.phase)
        if reason is not None:
            return reason
    reason = domain_reason(event.func or event.op, event.args, event.kwargs, event.phase)
    if reason is not None:
        return reason
    return overflow_reason(event, timeline, weights)


def _dst_dtype(event: Any) -> torch.dtype | None:
    """The dtype an op wrote: the cast's target (`dtype=`, or copy's destination), else None."""
    dtype = (event.kwargs or {}).get("dtype") if event.args is not None else None
    if isinstance(dtype, torch.dtype):
        return dtype
    if op_base(event.op) in ("copy", "_copy_from") and event.args:
        target = event.args[0] if op_base(event.op) == "copy" else event.args[1]
        return target.dtype if isinstance(target, torch.Tensor) else None
    return None


def overflow_reason(event: Any, timeline: Any, weights: WeightHistory | None = None) -> Reason:
    base = op_base(event.op)
    bound = overflow_bound(event.op, event.args, event.kwargs, _dst_dtype(event))
    made = signed(event.out_kinds - {"nan"}) if event.out_kinds - {"nan"} else "NaN"
    if bound is None:
        return _no_bound(event, base, made)
    name = dtype_name(bound.dtype)
    numbers = (f"the largest |input| was {bound.largest_input:.4g}, {name} max is "
               f"{bound.limit:.6g}")
    if bound.bound < bound.limit:
        return Reason(Cause.UNKNOWN, f"{base} made {made} from finite inputs, but its result "
                                     f"cannot exceed {bound.bound:.4g} ({bound.how}): {numbers}, "
                                     f"so this is not an overflow of these values")
    growth = growth_before(timeline)
    if bound.dtype not in LOW_PRECISION and growth:
        metric, start, factor = growth
        return Reason(Cause.DIVERGENCE, f"{base} overflowed {name} from finite inputs: {numbers} "
                                        f"({bound.how} can reach {bound.bound:.4g}); the "
                                        f"{metric.replace('_', ' ')} grew {factor:.3g}x from step "
                                        f"{start} before this step")
    # An optimizer's own series may not show it (another optimizer's check tripped, or the
    # growth was one step): the weights the op read say whether an update made them that large.
    grown = None if bound.dtype in LOW_PRECISION else grown_weight(event, bound,
                                                                   _dst_dtype(event), weights)
    if grown is not None:
        return grown
    # Past float32's range no wider dtype is the fix: something made the inputs that large.
    fix = None if bound.dtype in LOW_PRECISION else (
        "these inputs are too large for any dtype to be the fix: find what made them that "
        "large (a learning rate too high for the weights, inputs never normalized); lower the "
        "learning rate, clip the gradients, or scale the inputs")
    return Reason(Cause.DTYPE_OVERFLOW, f"{base} produced {made} from finite inputs: {numbers}; "
                                        f"{bound.how} can reach {bound.bound:.4g}, and {name} "
                                        f"holds at most {bound.limit:.6g}", fix=fix)


def _no_bound(event: Any, base: str, made: Any) -> Reason:
    tensors = [a for a in list(event.args or ()) + list((event.kwargs or {}).values())
               if isinstance(a, torch.Tensor) and a.is_floating_point()]
    largest = max((amax(t) for t in tensors), default=0.0)
    dtype = _dst_dtype(event) or (tensors[0].dtype if tensors else torch.float32)
    limit = torch.finfo(dtype).max
    numbers = f"the largest |input| was {largest:.4g}, {dtype_name(dtype)} max is {limit:.6g}"
    if largest >= limit * 1e-3:
        return Reason(Cause.DTYPE_OVERFLOW, f"{base} produced {made} from finite inputs near the "
                                            f"top of the range: {numbers}")
    return Reason(Cause.UNKNOWN, f"{base} made {made} from finite inputs ({numbers}); these "
                                 f"magnitudes do not overflow and no rule for {base} explains it")


# --- the diagnosis of one creating op ---------------------------------------------------------

def diagnose(event: Any, kind: str, timeline: Any,
             weights: WeightHistory | None = None) -> Diagnosis:
    """The cause of a value of `kind` ('nan' or 'inf') created by `event` from its own inputs
    (the localizer has already followed any infinity it received back to its maker)."""
    forward = event.forward
    subject = (forward.func or forward.op, forward.args, forward.kwargs) \
        if event.phase == Where.BACKWARD and forward is not None else None
    reason = domain_reason(*subject, event.phase) if subject else None
    if reason is None:
        reason = domain_reason(event.func or event.op, event.args, event.kwargs, event.phase)
    if reason is not None:
        text = reason.text
        if event.phase == Where.BACKWARD and subject:
            text += f" (backward of {op_base(forward.op)} computed {op_base(event.op)})"
        return as_diagnosis(reason, text)
    infinite = any(k & {"inf", "-inf"} for k in event.in_kinds) or \
        bool(scalar_infinities(event.args, event.kwargs, event.op))
    if kind == "inf" and not infinite and not any("nan" in k for k in event.in_kinds):
        return as_diagnosis(overflow_reason(event, timeline, weights))
    if kind == "nan" and infinite:
        text = (f"{op_base(event.op)} combined infinite inputs into NaN (inf - inf, 0 * inf or "
                f"inf / inf)")
        return Diagnosis(Cause.INF_ARITHMETIC, text, fix_for(Cause.INF_ARITHMETIC))
    if kind == "nan" and not infinite and not any(event.in_kinds):
        found = overflow_reason(event, timeline, weights)
        if found.cause != Cause.UNKNOWN:   # partial results overflowed to +inf and -inf and met
            return as_diagnosis(found, found.text.replace(
                "produced nan", "produced NaN").replace(
                "from finite inputs", "from finite inputs (its partial results overflowed to "
                                      "+inf and -inf, and inf - inf = NaN)", 1))
    held = sorted(set().union(*event.in_kinds)) if event.in_kinds else []
    inputs = (f"inputs that already held {', '.join(held)}" if held
              else "inputs that were all finite")
    text = f"{op_base(event.op)} made {kind} from {inputs}"
    return Diagnosis(Cause.UNKNOWN, text, fix_for(Cause.UNKNOWN))


def masked_gradient(event: Any, forward: Any, reason: Reason | None, origin_text: str | None = None
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
    fix = fix_for(Cause.MASKED_NONFINITE_GRADIENT)
    if reason:
        source_fix = reason.fix or fix_for(reason.cause)
        fix += f"; or remove the {reason.cause} at its source: {source_fix}"
    return Diagnosis(Cause.MASKED_NONFINITE_GRADIENT, text, fix)
