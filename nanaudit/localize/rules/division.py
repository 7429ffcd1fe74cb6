"""Domain rules of division and of the averages that divide by a count: x/0 and 0/0, std / var
with no degrees of freedom left, the mean of an empty tensor.

A plain division or reciprocal by zero stays `div-by-zero` (a negative power at 0 is a pole,
see exp_log); an average over too few elements is `degenerate-reduction`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at
from nanaudit.report.vocabulary import Cause

DIV_OPS = ("div", "true_divide", "reciprocal", "remainder", "fmod", "floor_divide")


@domain_rule(*DIV_OPS)
def div_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    if base == "reciprocal":
        num, den = None, args[0]
    else:
        num = args[0] if isinstance(args[0], torch.Tensor) else None
        den = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(den, (int, float)):
        return Reason(Cause.DIV_BY_ZERO, f"{base} by the constant 0") if den == 0 else None
    if not isinstance(den, torch.Tensor):
        return None
    operand, den = den, den.detach()
    if num is not None and bool(torch.isinf(num).any()) and bool(torch.isinf(den).any()):
        return Reason(Cause.INF_ARITHMETIC,
                      f"{base} received infinities in both numerator and denominator")
    zero = den == 0
    if not count(zero):
        return None
    detail = ""
    if num is not None and num.shape == den.shape:
        zz = count(zero & (num.detach() == 0))
        detail = f"; {zz} of them over a zero numerator (0/0 = NaN)" if zz else ""
    return Reason(Cause.DIV_BY_ZERO, f"the denominator of {base} holds {count(zero)} zero(s) of "
                                     f"{den.numel()}{first_at(zero)}{detail}", operand=operand,
                  mask=zero)


@domain_rule("std", "var", "std_mean", "var_mean")
def var_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
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
    return Reason(Cause.DEGENERATE_REDUCTION, f"{base} reduced over {n} element(s) with "
                                              f"correction={correction:g}: {n - correction:g} "
                                              f"degrees of freedom")


@domain_rule("mean")
def mean_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    x = args[0]
    if isinstance(x, torch.Tensor) and x.numel() == 0:
        return Reason(Cause.DEGENERATE_REDUCTION, f"{base} of an empty tensor of shape "
                                                  f"{tuple(x.shape)}")
    return None
