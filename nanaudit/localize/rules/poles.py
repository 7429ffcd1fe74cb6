"""Domain rules of functions with poles and bounded domains: lgamma / digamma / polygamma at 0
or a negative integer, zeta at 1, tan at pi/2; acos / asin / atanh outside [-1, 1] or on its
edge in backward, atan2 at (0, 0).

An argument exactly on a pole usually got there by rounding (softplus or exp of a large negative
number underflows to 0); the operand is returned so the walk can say where it came from.
"""

from __future__ import annotations

from typing import Any

import torch

from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at, number
from nanaudit.report.vocabulary import Cause


def _on_integer_pole(x: torch.Tensor) -> torch.Tensor:
    return (x <= 0) & (x == x.round())


@domain_rule("lgamma", "digamma", "polygamma", "mvlgamma", "special_zeta", "tan")
def pole_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
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
    if not count(on):
        return None
    value = number(float(x[on].flatten()[0]))
    return Reason(Cause.POLE, f"{base} received {count(on)} of {x.numel()} value(s) exactly on a "
                              f"pole{first_at(on)} (e.g. {value}): {what}, so {base}({value}) is "
                              f"infinite", operand=operand, mask=on)


@domain_rule("acos", "asin", "atanh", "atan2")
def trig_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    if base == "atan2":
        y, x = args[0].detach(), args[1].detach()
        both = (y == 0) & (x == 0)
        if count(both):
            return Reason(Cause.TRIG_DOMAIN, f"atan2 received (0, 0) at {count(both)} "
                                             f"position(s){first_at(both)}; its derivative "
                                             f"x/(x²+y²) is 0/0 there")
        return None
    x = args[0].detach()
    outside = x.abs() > 1
    if count(outside):
        return Reason(Cause.TRIG_DOMAIN, f"{base} received {count(outside)} value(s) outside "
                                         f"[-1, 1]{first_at(outside)} (min "
                                         f"{number(float(x.min()))}, max "
                                         f"{number(float(x.max()))})", operand=args[0],
                      mask=outside)
    edge = x.abs() == 1
    if count(edge):
        slope = "1/(1-x²)" if base == "atanh" else "1/sqrt(1-x²)"
        return Reason(Cause.TRIG_DOMAIN, f"{base} received exactly ±1 at {count(edge)} "
                                         f"position(s){first_at(edge)}; the derivative {slope} "
                                         f"is infinite there", operand=args[0], mask=edge)
    return None
