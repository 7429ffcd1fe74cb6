"""The update rules of torch's optimizers, read at one element of a parameter from the state the
step left (script/update_replay.py says why the state and nothing else): each rule gives the
division the update made there (its denominator, and the whole subtracted term where the state
holds its numerator too) or, for a rule that divides nothing, the term.

The formulas are torch.optim's own (2.x, single-tensor and foreach alike). The second-moment
state after the step is the very value the update divided by, so a zero denominator (eps 0 over
an accumulator no gradient has reached) is exact. A numerator that is the step's gradient
(RMSprop, Adagrad, NAdam, Adadelta) is gone by the check: the term is then not evaluated, and
only a zero denominator is said."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Index = tuple[int, ...]


@dataclass(frozen=True)
class Division:
    """What an update rule made at one element: `said` (the rule with its values), the
    `denominator` it divided by (None: it divides nothing), the subtracted `term` (None: its
    numerator, the gradient, is gone), whether that numerator is known to be 0 (None: unknown),
    and the name of the accumulator a zero denominator comes from."""

    said: str
    denominator: float | None
    term: float | None
    numerator_zero: bool | None = None
    accumulator: str = "second moment"


def _at(state: dict, key: str, index: Index) -> float | None:
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.is_complex():
        return None             # a complex parameter's rule runs on its real view
    return float(value.detach()[index].double()) if value.dim() else float(value)


def _held(x: float, state: dict, key: str) -> float:
    """`x` as state[key]'s dtype holds it: the update computes in the parameter's dtype, where
    eps=1e-8 added to 0 is 0 in float16 (the Python float would keep it)."""
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.dtype == torch.float64 or math.isnan(x):
        return x
    return float(torch.tensor(x, dtype=value.dtype))


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else math.nan


def _adam(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    m = _at(state, "exp_avg", index)
    v = _at(state, _second_moment(group), index)
    t = _at(state, "step", ())
    if m is None or v is None or t is None:
        return None
    beta1, beta2 = (float(b) for b in group["betas"])
    eps = float(group["eps"])
    denom = _held(_sqrt(v) / math.sqrt(1 - beta2 ** t) + eps, state, _second_moment(group))
    said = (f"Adam's update (t = {int(t)}) divides exp_avg {m:.6g} by sqrt(exp_avg_sq "
            f"{v:.6g}) / sqrt(1 - beta2^t) + eps {eps:g} = {denom:.6g}")
    term = lr / (1 - beta1 ** t) * m / denom if denom else None
    return Division(said, denom, term, m == 0)


def _second_moment(group: dict) -> str:
    """The state Adam's update divides by: its running max under amsgrad."""
    return "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"


def _adamax(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    m, u, t = _at(state, "exp_avg", index), _at(state, "exp_inf", index), _at(state, "step", ())
    if m is None or u is None or t is None:
        return None
    beta1 = float(group["betas"][0])
    said = (f"Adamax's update (t = {int(t)}) divides exp_avg {m:.6g} by exp_inf {u:.6g} "
            f"(the running max of |grad| + eps {float(group['eps']):g})")
    term = lr / (1 - beta1 ** t) * m / u if u else None
    return Division(said, u, term, m == 0, accumulator="running max of |grad|")


def _radam(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    m, v, t = _at(state, "exp_avg", index), _at(state, "exp_avg_sq", index), _at(state, "step", ())
    if m is None or v is None or t is None:
        return None
    beta1, beta2 = (float(b) for b in group["betas"])
    eps = float(group["eps"])
    corrected = m / (1 - beta1 ** t)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t)
    if rho_t <= 5:          # the variance is not tractable yet: an SGD-like step, no division
        return Division(f"RAdam's update (t = {int(t)}, unrectified) is lr x exp_avg / "
                        f"(1 - beta1^t) = {lr * corrected:.6g}", None, lr * corrected)
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    denom = _held(_sqrt(v) + eps, state, "exp_avg_sq")
    said = (f"RAdam's update (t = {int(t)}) divides exp_avg {m:.6g} by sqrt(exp_avg_sq {v:.6g}) "
            f"+ eps {eps:g} = {denom:.6g}")
    term = corrected * lr * math.sqrt(1 - beta2 ** t) / denom * rect if denom else None
    return Division(said, denom, term, m == 0)


def _nadam(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    v, t = _at(state, "exp_avg_sq", index), _at(state, "step", ())
    if v is None or t is None:
        return None
    eps = float(group["eps"])
    denom = _held(_sqrt(v / (1 - float(group["betas"][1]) ** t)) + eps, state, "exp_avg_sq")
    return Division(f"NAdam's update (t = {int(t)}) divides the gradient and exp_avg by "
                    f"sqrt(exp_avg_sq {v:.6g} / (1 - beta2^t)) + eps {eps:g} = {denom:.6g}",
                    denom, None)


def _rmsprop(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    square = _at(state, "square_avg", index)
    if square is None:
        return None
    eps = float(group["eps"])
    said = f"RMSprop's update divides the gradient by sqrt(square_avg {square:.6g}"
    if group.get("centered"):
        mean = _at(state, "grad_avg", index)
        if mean is None:
            return None
        square -= mean * mean
        said += f" - grad_avg {mean:.6g}^2"
    denom = _held(_sqrt(square) + eps, state, "square_avg")
    said += f") + eps {eps:g} = {denom:.6g}"
    buf = _at(state, "momentum_buffer", index) if float(group.get("momentum", 0.0)) else None
    if buf is not None:     # with momentum the buffer after the step is the update / lr
        said += f", into the momentum buffer {buf:.6g}"
    return Division(said, denom, lr * buf if buf is not None and denom else None)


def _adagrad(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    total, t = _at(state, "sum", index), _at(state, "step", ())
    if total is None or t is None:
        return None
    eps = float(group["eps"])
    denom = _held(_sqrt(total) + eps, state, "sum")
    return Division(f"Adagrad's update (t = {int(t)}) divides the gradient by sqrt(sum "
                    f"{total:.6g}) + eps {eps:g} = {denom:.6g}", denom, None,
                    accumulator="sum of squared gradients")


def _adadelta(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    square = _at(state, "square_avg", index)
    if square is None:
        return None
    eps = float(group["eps"])
    denom = _sqrt(_held(square + eps, state, "square_avg"))
    return Division(f"Adadelta's update divides sqrt(acc_delta + eps) x the gradient by "
                    f"sqrt(square_avg {square:.6g} + eps {eps:g}) = {denom:.6g}", denom, None)


def _sgd(group: dict, state: dict, index: Index, lr: float) -> Division | None:
    if not float(group.get("momentum", 0.0)):
        return None        # the update is the gradient, gone by the check
    buf = _at(state, "momentum_buffer", index)
    if buf is None:
        return None
    return Division(f"lr {lr:g} x momentum buffer {buf:.6g}", None, lr * buf)


_RULES: dict[type, Callable[[dict, dict, Index, float], Division | None]] = {
    torch.optim.Adam: _adam, torch.optim.AdamW: _adam, torch.optim.Adamax: _adamax,
    torch.optim.RAdam: _radam, torch.optim.NAdam: _nadam, torch.optim.RMSprop: _rmsprop,
    torch.optim.Adagrad: _adagrad, torch.optim.Adadelta: _adadelta, torch.optim.SGD: _sgd,
}
EVALUATED = ", ".join(sorted({kind.__name__ for kind in _RULES}))


def evaluate(optimizer: Any, group: dict, state: dict, index: Index) -> Division | None:
    """The division `optimizer`'s rule made at `index`, from `state` after the step; None: not
    evaluated (another optimizer, or its state lacks what the rule reads)."""
    rule = _RULES.get(type(optimizer))
    return None if rule is None else rule(group, state, index, float(group["lr"]))


# The state each rule reads (the moments it divides, the accumulator, the update itself), by key.
_READ: dict[type, tuple[str, ...]] = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq"), torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
    torch.optim.Adamax: ("exp_avg", "exp_inf"), torch.optim.RAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.NAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.RMSprop: ("square_avg", "grad_avg", "momentum_buffer"),
    torch.optim.Adagrad: ("sum",), torch.optim.Adadelta: ("square_avg", "acc_delta"),
    torch.optim.SGD: ("momentum_buffer",),
}


def state_read(optimizer: Any, group: dict) -> tuple[str, ...]:
    """The state keys `optimizer`'s rule reads for `group` (none for another optimizer)."""
    keys = _READ.get(type(optimizer), ())
    return tuple(_second_moment(group) if key == "exp_avg_sq" and type(optimizer) in
                 (torch.optim.Adam, torch.optim.AdamW) else key for key in keys)
