"""Domain rules of norms and distances: the norm of an all-zero vector, or the distance between
identical points, is finite in forward but its gradient x/|x| is 0/0 in backward."""

from __future__ import annotations

import torch

from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at
from nanaudit.report.vocabulary import Cause

NORM_OPS = {"linalg_vector_norm", "norm", "frobenius_norm", "dist"}
DISTANCE_OPS = {"cdist", "_cdist_forward", "_euclidean_dist"}


@domain_rule(*NORM_OPS, *DISTANCE_OPS)
def norm_rule(base, args, kwargs, phase):
    x = args[0].detach()
    if base in DISTANCE_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        d = torch.cdist(x.double(), args[1].detach().double())
        zero = d == 0
        if count(zero):
            return Reason(Cause.NORM_AT_ZERO, f"{base} received identical points at "
                                              f"{count(zero)} pair(s){first_at(zero)}: a zero "
                                              f"distance, whose gradient is 0/0")
        return None
    dim = args[2] if base == "linalg_vector_norm" and len(args) > 2 else kwargs.get("dim")
    norms = torch.linalg.vector_norm(x.double(), dim=dim)
    zero = norms == 0
    if count(zero):
        return Reason(Cause.NORM_AT_ZERO, f"{base} received {count(zero)} all-zero vector(s)"
                                          f"{first_at(zero)}: the norm is 0 and its gradient "
                                          f"x/|x| is 0/0")
    return None
