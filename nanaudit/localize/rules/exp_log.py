"""Domain rules of the exponential family: log below its domain, sqrt and fractional powers of a
negative value (or at 0 in backward), a negative power at 0, exp above log(dtype max).

The limits come from the dtype (exp overflows float32 above 88.7, float16 above 11.1), never
from a fixed threshold.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanaudit.localize.ops import dtype_name
from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at, number
from nanaudit.report.vocabulary import Cause, Where

LOG_BOUNDS = {"log": 0.0, "log2": 0.0, "log10": 0.0, "log1p": -1.0}


@domain_rule("log", "log2", "log10", "log1p", "xlogy")
def log_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    if base == "xlogy":
        y = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if y is not None and count(y < 0):
            return Reason(Cause.LOG_DOMAIN, f"xlogy received y < 0 at {count(y < 0)} position(s)"
                                            f"{first_at(y < 0)}; min {number(float(y.min()))}")
        return None
    x = args[0].detach()
    bound = LOG_BOUNDS[base]
    bad = x <= bound
    if not count(bad):
        return None
    word = "<= -1" if bound < 0 else "<= 0"
    edge = (x == bound) & bad
    made = (f"; {base} of exactly {int(bound)} is -inf" if count(edge) else "")
    return Reason(Cause.LOG_DOMAIN, f"{base} received {count(bad)} of {x.numel()} value(s) "
                                    f"{word}{first_at(bad)} (min {number(float(x.min()))}); "
                                    f"{base} is defined only for x > {int(bound)}{made}",
                  operand=args[0], mask=bad)


NEGATIVE_BASE_FIX = ("a fractional power of a negative base is NaN: for a signed root use "
                     "`torch.sign(x) * x.abs() ** p`; for a power mean (GeM pooling) clamp the "
                     "base first, `x.clamp(min=eps) ** p`")


@domain_rule("sqrt", "rsqrt")
def sqrt_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    x = args[0].detach()
    if count(x < 0):
        return Reason(Cause.SQRT_DOMAIN, f"{base} received {count(x < 0)} negative value(s)"
                                         f"{first_at(x < 0)} (min {number(float(x.min()))})",
                      operand=args[0], mask=x < 0)
    if count(x == 0):
        zeros = f"{base} received exact zeros at {count(x == 0)} of {x.numel()} position(s)" \
                f"{first_at(x == 0)}"
        if base == "rsqrt" and phase == Where.FORWARD:
            return Reason(Cause.SQRT_DOMAIN, f"{zeros}; rsqrt(0) = 1/sqrt(0) is inf",
                          operand=args[0], mask=x == 0)
        deriv = "1/(2*sqrt(x))" if base == "sqrt" else "-1/(2*x^1.5)"
        when = "its backward" if phase == Where.BACKWARD else base
        return Reason(Cause.SQRT_DOMAIN, f"{zeros}; {base}(0) is finite but the derivative "
                                         f"{deriv} is infinite at 0, so {when} made a "
                                         f"non-finite value", operand=args[0], mask=x == 0)
    return None


def _exponent(args: tuple, kwargs: dict) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("exponent")


@domain_rule("pow", "float_power")
def pow_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
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
        shown = number(float(e)) if e.numel() == 1 else f"in [{number(float(e.min()))}, " \
                                                         f"{number(float(e.max()))}]"
    elif isinstance(exponent, (int, float)):
        frac = float(exponent) != int(exponent)
        negative_e = exponent < 0
        shown = number(float(exponent))
    else:
        return None
    negative = x < 0
    if frac and count(negative):
        return Reason(Cause.SQRT_DOMAIN, f"pow received a negative base at {count(negative)} "
                                         f"position(s){first_at(negative)} (min "
                                         f"{number(float(x.min()))}) with the fractional "
                                         f"exponent {shown}: a real power of a negative number "
                                         f"is NaN", fix=NEGATIVE_BASE_FIX, operand=args[0],
                      mask=negative)
    zero = x == 0
    if negative_e and count(zero):
        return Reason(Cause.POLE, f"pow received exact zeros at {count(zero)} of {x.numel()} "
                                  f"position(s){first_at(zero)} with the negative exponent "
                                  f"{shown}: x ** {shown} has a pole at 0 (0 ** {shown} = inf)",
                      operand=args[0], mask=zero)
    small = isinstance(exponent, (int, float)) and 0 < float(exponent) < 1
    if phase == Where.BACKWARD and small and count(zero):
        return Reason(Cause.SQRT_DOMAIN, f"pow(x, {exponent}) received exact zeros at "
                                         f"{count(zero)} position(s){first_at(zero)}; its "
                                         f"derivative {exponent} * x^{float(exponent) - 1:g} is "
                                         f"infinite at 0", operand=args[0], mask=zero)
    return None


def _scalar_base_rule(base_value: Any, exponent: Any) -> Any:
    if not isinstance(exponent, torch.Tensor) or not isinstance(base_value, (int, float)) \
            or abs(base_value) <= 1:
        return None
    e = exponent.detach()
    limit = math.log(torch.finfo(e.dtype).max) / math.log(abs(base_value))
    bad = e > limit
    if not count(bad):
        return None
    return Reason(Cause.EXP_OVERFLOW, f"{number(base_value)} ** x received x = "
                                      f"{number(float(e.max()))}{first_at(bad)}; in "
                                      f"{dtype_name(e.dtype)} it overflows above x = {limit:.1f}")


def exp_limit(dtype: torch.dtype) -> float:
    """The largest x whose exp the dtype holds: log(dtype max)."""
    return math.log(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf


@domain_rule("exp", "exp2", "expm1", "cosh", "sinh", "special_i0", "i0", "special_i1",
             "special_erfcx")
def exp_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
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
    if not count(bad):
        return None
    return Reason(Cause.EXP_OVERFLOW, f"{base} received {number(float(magnitude.max()))}"
                                      f"{first_at(bad)}; {dtype_name(x.dtype)} {base} overflows "
                                      f"above {limit:.1f} ({count(bad)} of {x.numel()} value(s) "
                                      f"above it)")
