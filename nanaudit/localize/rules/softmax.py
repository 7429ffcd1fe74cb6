"""The domain rule of softmax-like ops over a row of nothing but -inf (a fully masked or empty
sequence): softmax is 0/0 = NaN, logsumexp is log(0) = -inf.

A -inf written by a mask is deliberate; it becomes a finding only at the op that reduced a whole
row of them, which is what this rule recognises (the walk asks it of every softmax on the path).
"""

from __future__ import annotations

import math

from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at
from nanaudit.report.vocabulary import Cause


@domain_rule("_softmax", "_log_softmax", "softmax", "log_softmax", "logsumexp")
def masked_row_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Reason | None:
    """A row of nothing but -inf: softmax is 0/0 = NaN, logsumexp is log(0) = -inf."""
    x = args[0].detach()
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    rows = (x == -math.inf).all(dim=dim)
    if not count(rows):
        return None
    result = ("the log of an empty sum, -inf" if base == "logsumexp"
              else "every exp is 0 and 0/0 = NaN")
    return Reason(Cause.SOFTMAX_ALL_MASKED, f"{base.lstrip('_')} received {count(rows)} row(s) "
                                            f"whose entries are all -inf{first_at(rows)} (a "
                                            f"fully masked or empty sequence): {result}")
