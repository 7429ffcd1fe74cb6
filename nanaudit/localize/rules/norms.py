"""Domain rules of norms and distances: the norm of an all-zero vector, or the distance between
identical points, is finite in forward but its gradient x/|x| is 0/0 in backward."""

from __future__ import annotations

import torch

from nanaudit.localize.rules.registry import Reason, count, domain_rule, first_at
from nanaudit.report.vocabulary import Cause

NORM_OPS = {"linalg_vector_norm", "norm", "frobenius_norm", "dist"}
DISTANCE_OPS = {"cdist", "_cdist_forward", "_euclidean_dist"}


@domain_rule(*NORM_OPS, *DISTANCE_OPS)
def norm_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Reason | None:
    x = args[0].detach()
    if base in DISTANCE_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        zero = torch.cdist(x.double(), args[1].detach().double()) == 0
        what = "identical points at {n} pair(s){at}: a zero distance, whose gradient is 0/0"
    else:
        dim = args[2] if base == "linalg_vector_norm" and len(args) > 2 else kwargs.get("dim")
        zero = torch.linalg.vector_norm(x.double(), dim=dim) == 0
        what = "{n} all-zero vector(s){at}: the norm is 0 and its gradient x/|x| is 0/0"
    n = count(zero)
    if not n:
        return None
    return Reason(Cause.NORM_AT_ZERO, f"{base} received " + what.format(n=n, at=first_at(zero)))


# weight_norm's w = g * v / |v|, the norm over every dim of v but `dim` (all of them at -1): it
# has no eps, so a slice of v that is all zero (a zero-initialized or pruned row) is 0/0 in
# forward and backward alike.
@domain_rule("_weight_norm_interface", "_weight_norm")
def weight_norm_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Reason | None:
    v = args[0].detach()
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if v.dim() == 0:
        return None
    dim = dim % v.dim() if dim is not None and dim != -1 else None
    over = [d for d in range(v.dim()) if d != dim]
    zero = torch.linalg.vector_norm(v.double(), dim=over) == 0
    n = count(zero)
    if not n:
        return None
    slices = f"slice(s) along dim {dim}" if dim is not None else "tensor"
    return Reason(Cause.NORM_AT_ZERO,
                  f"{base} (weight_norm: g * v / |v|, with no eps) received a v whose norm is 0 "
                  f"in {n} {slices}{first_at(zero) if dim is not None else ''}: 0/0",
                  fix="weight_norm divides by the norm of each slice of the weight with no eps: "
                      "keep every slice of the weight nonzero (a zero-initialized or pruned row "
                      "is 0/0), or mask such rows out of the layer instead of zeroing them")
