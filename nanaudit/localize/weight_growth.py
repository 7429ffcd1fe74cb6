"""A float32 overflow that an optimizer's update made: the op read a parameter that the update
grew far past its size at the first check, and at that size the op could not have overflowed.

A learning rate too high (Adam at lr 1e20, a GAN's generator at 10.0) makes the weights it
updates enormous but finite in one step; the next forward that reads them overflows float32.
Where several optimizers take turns (a GAN), the trip's check reads only its own optimizer's
weights, and its timeline shows no growth: the overflowing op's own inputs are the evidence. The
script's ledger (or the session) says which optimizer holds each parameter, when it last
stepped, at what learning rate, and how large its weights were at their first read
(`WeightHistory`): this module decides from those values alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nanaudit.localize.causes import divergence_fix
from nanaudit.localize.ops import dtype_name, named_tensors, op_base
from nanaudit.localize.overflow import Bound, amax, overflow_bound
from nanaudit.localize.rules.registry import Reason
from nanaudit.report.vocabulary import Cause

# How far past its first read a weight must have grown before its growth is the story. A
# training step moves a weight by about the learning rate (Adam) or lr x gradient (SGD): with
# any learning rate a run survives, weights stay within a small multiple of their initial
# scale. Three orders of magnitude is no drift; below that, an overflow is the inputs' own.
GROWTH = 1e3


@dataclass(frozen=True)
class WeightUpdate:
    """Who last updated a parameter, and how large its weights were before any update."""

    name: str                 # the parameter's qualified name
    optimizer: str            # `Adam(lr=1e+20, ...)`, or "the script's own update"
    step: int | None          # the step of that optimizer's last update (None: not known)
    lr: float | None          # the learning rate of the parameter's group
    first: float              # an upper bound of its |values| at its first check (the norm
    #                           of the weights that check read: no |value| exceeds it)


class WeightHistory(Protocol):
    """What a checker knows of the parameters its script's optimizers update."""

    def update_of(self, parameter: torch.Tensor) -> WeightUpdate | None:
        """The update that last changed `parameter`; None when no optimizer has updated it."""


class OptimizersWeights:
    """The WeightHistory of a step loop that holds its optimizers (`scan`, Sentinel): each
    optimizer by its name, every one stepped at the step before the trip unless the user's own
    step decides (then which step is not known), and the model's weights' norm at the first
    step, read before any update (the timeline's first entry)."""

    def __init__(self, optimizers: dict[str, Any], names: dict[int, str], first: float | None,
                 last_step: int | None) -> None:
        self.optimizers, self.names = optimizers, names
        self.first, self.last_step = first, last_step

    def update_of(self, parameter: torch.Tensor) -> WeightUpdate | None:
        if self.first is None:
            return None
        for label, optimizer in self.optimizers.items():
            group = group_of(optimizer, parameter)
            if group is not None:
                name = self.names.get(id(parameter), f"<parameter {tuple(parameter.shape)}>")
                return WeightUpdate(name, f"{type(optimizer).__name__} `{label}`",
                                    self.last_step, lr_of(group), self.first)
        return None


def group_of(optimizer: Any, parameter: torch.Tensor) -> dict | None:
    """The param group of `optimizer` that holds `parameter` (by identity), else None."""
    return next((g for g in getattr(optimizer, "param_groups", ())
                 if any(p is parameter for p in g["params"])), None)


def lr_of(group: dict) -> float | None:
    """A param group's learning rate as a number (a 0-dim tensor's too), else None."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        return float(lr)
    return float(lr) if isinstance(lr, (int, float)) else None


def _parameter(t: Any) -> torch.Tensor | None:
    """The leaf `t` is or views (`weight.t()` in a linear's addmm), else None. Not asked to
    require grad: Lightning's `toggle_optimizer` turns it off for the other optimizers'
    weights while one trains, and the history says whether an optimizer holds it."""
    if not isinstance(t, torch.Tensor):
        return None
    root = t._base if t._base is not None else t
    return root if root.is_leaf else None


def grown_weight(event: Any, bound: Bound, out_dtype: torch.dtype | None,
                 weights: WeightHistory | None) -> Reason | None:
    """`divergence` when one of the overflowing op's inputs is a parameter an optimizer grew
    GROWTH-fold past its first read, and with that input back at its first size the op's
    result (written in `out_dtype`, None: the inputs' own) could not have reached the dtype's
    range; else None."""
    if weights is None or event.args is None:
        return None
    for arg_name, t in named_tensors(event.arg_names, event.args, event.kwargs):
        parameter = _parameter(t)
        update = weights.update_of(parameter) if parameter is not None else None
        if update is None:
            continue
        peak = amax(t)
        if not (math.isfinite(update.first) and peak > 0 and peak >= GROWTH * update.first):
            continue
        at_first = _bound_at(event, t, update.first / peak, out_dtype)
        if at_first is not None and at_first < bound.limit:
            return _reason(event, bound, arg_name, peak, at_first, update)
    return None


def _bound_at(event: Any, t: torch.Tensor, scale: float,
              out_dtype: torch.dtype | None) -> float | None:
    """The op's largest |result| had its input `t` been `scale` times its size."""
    smaller = t.detach() * scale
    args = tuple(smaller if a is t else a for a in event.args)
    kwargs = {k: smaller if v is t else v for k, v in (event.kwargs or {}).items()}
    found = overflow_bound(event.op, args, kwargs, out_dtype)
    return found.bound if found is not None else None


def _reason(event: Any, bound: Bound, arg_name: str, peak: float, at_first: float,
            update: WeightUpdate) -> Reason:
    base, name = op_base(event.op), dtype_name(bound.dtype)
    lr = f"lr {update.lr:.4g}" if update.lr is not None else "its learning rate"
    by = update.optimizer or "the script's own update"
    when = f" at step {update.step}" if update.step is not None else " before this step"
    grown = (f"at least {peak / update.first:.3g}x its size at the first check"
             if update.first > 0 else "all zeros at the first check")
    text = (f"{base} overflowed {name} from finite inputs: the largest |input| was "
            f"{bound.largest_input:.4g}, {name} max is {bound.limit:.6g} ({bound.how} can reach "
            f"{bound.bound:.4g}); its {arg_name} is the parameter {update.name}, whose largest "
            f"|value| was {peak:.4g}, {grown} (the weights read there had a norm of "
            f"{update.first:.4g}): {by} last updated it{when}, at {lr} for its group. At its "
            f"first size the result could reach only {at_first:.4g}: the update made the "
            f"weights diverge")
    fix = divergence_fix(f"{by}, {lr} for the group of {update.name}",
                         "the optimizer whose update grew these weights")
    return Reason(Cause.DIVERGENCE, text, fix=fix)
