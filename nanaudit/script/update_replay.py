"""`nanaudit run`'s in-process account of an update trip (Check.OPTIMIZER: the optimizer's step
made a parameter non-finite from finite gradients), at the trip, with no re-run.

The check that trips reads the weights before the NEXT step's update, so the update's inputs
(the weights, gradients and state before it) are gone: torch's optimizers update in place, and
keeping them would be a per-step copy of the weights, which the leave-on path never makes. No
replay of the update's ops is sound from what is left, and none is attempted (inverting an
update is not sound either: `exp_avg.lerp_` rounds, and the gradient is overwritten by the next
backward).

What is left is exact where it matters: Adam's and AdamW's moments after the step are the very
values its update divided (`lr / (1 - beta1^t) * exp_avg / (sqrt(v) / sqrt(1 - beta2^t) + eps)`,
`v` the second moment, or its running maximum under amsgrad), and SGD's momentum buffer after
the step is its update (`lr * buf`). So at the parameter's first non-finite element that term is
evaluated again from the optimizer's own state and hyper-parameters (float64, one element, one
read) and the rule that made the value is named: a non-finite learning rate; a zero denominator
(eps 0 over a zero second moment, an element no gradient has reached) making 0/0 or x/0; a
quotient that overflowed; or a finite update whose sum with the weight overflowed. A term that
cannot have made the value the run saw is not believed. Other optimizers, SGD without momentum
(its update is the gradient, overwritten since), a sharded (DTensor) parameter and a
hand-written update keep the first run's finding, and the record says why."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from nanaudit.report.model import Finding
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import RerunStatus
from nanaudit.run.sharded import is_sharded
from nanaudit.script.inprocess import IN_PROCESS
from nanaudit.script.trip import ScriptTrip


def localize_update(auditor: Any, trip: ScriptTrip, finding: Finding) -> Rerun:
    """Explain `finding` (the first run's, of an update trip) from the optimizer's state after
    the update (see the module docstring); the record says whether it could, and why not."""
    started = time.perf_counter()
    found = _bad_parameter(auditor, trip)
    if found is None:
        return Rerun(status=RerunStatus.SKIPPED, note="the update was the script's own (no "
                     "optimizer state to evaluate it from)")
    optimizer, group, param, name = found
    group = _as_run(auditor, optimizer, group)
    if is_sharded(param):
        return Rerun(status=RerunStatus.SKIPPED, note="the update rule is not evaluated on a "
                     "sharded (DTensor) parameter: its elements live on several ranks")
    index = _first_bad(param)
    rule = _rule(optimizer, group, optimizer.state.get(param, {}), param, index)
    if rule is None:
        return Rerun(status=RerunStatus.SKIPPED, note=(
            f"the update rule of {type(optimizer).__name__} is not evaluated in-process (Adam, "
            f"AdamW, and SGD with momentum are: their state after the step holds the update)"))
    took = round(time.perf_counter() - started, 3)
    if rule.startswith("!"):
        return Rerun(steps=1, duration_s=took, status=RerunStatus.NOT_REPRODUCED, note=rule[1:])
    finding.explain(f"at {name}{list(index)}{_rows(param, name)}: {rule}")
    finding.localized_by = IN_PROCESS
    return Rerun(steps=1, duration_s=took, status=RerunStatus.REPRODUCED, ops_traced=0)


def _bad_parameter(auditor: Any, trip: ScriptTrip) -> tuple[Any, dict, torch.Tensor, str] | None:
    """(the optimizer, its group, the parameter, its name) of the first bad parameter."""
    wanted = trip.tensors[0] if trip.tensors else None
    optimizers = [o for o in auditor.ledger.stepped.values()
                  if isinstance(o, torch.optim.Optimizer)]     # not the script's own update
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if auditor.parameter_name(p) == wanted and (
                        is_sharded(p) or not bool(torch.isfinite(p).all())):
                    return optimizer, group, p, wanted
    return None


def _as_run(auditor: Any, optimizer: Any, group: dict) -> dict:
    """`group` with the learning rate its update ran with: a scheduler may have set the next
    step's since (a warm-up, the Trainer's scheduler stepping right after the update)."""
    index = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
    rate = auditor.ledger.update_rate(optimizer, index)
    return {**group, "lr": rate} if isinstance(rate, (int, float)) else group


def _first_bad(param: torch.Tensor) -> tuple[int, ...]:
    bad = (~torch.isfinite(param.detach())).nonzero()
    return tuple(int(i) for i in bad[0].tolist()) if bad.numel() else ()


def _rows(param: torch.Tensor, name: str) -> str:
    """The rows (first index) of a matrix parameter holding non-finite values."""
    if param.dim() < 2:
        return ""
    rows = (~torch.isfinite(param.detach())).flatten(1).any(1).nonzero().flatten().tolist()
    shown = ", ".join(str(r) for r in rows[:16]) + (", ..." if len(rows) > 16 else "")
    return f" (rows [{shown}] of {name}'s {param.shape[0]} hold non-finite values)"


def _at(state: dict, key: str, index: tuple[int, ...]) -> float | None:
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        return None
    return float(value.detach()[index].double()) if value.dim() else float(value)


def _rule(optimizer: Any, group: dict, state: dict, param: torch.Tensor,
          index: tuple[int, ...]) -> str | None:
    """What made the element, from the optimizer's state after the step; None: not evaluated
    for this optimizer; a text starting with "!": the state cannot have made it."""
    lr = float(group["lr"])
    if not math.isfinite(lr):
        return f"the learning rate is {lr}: every update it scales is non-finite"
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return _adam(group, state, param, index, lr)
    if kind is torch.optim.SGD and float(group.get("momentum", 0.0)):
        buf = _at(state, "momentum_buffer", index)
        if buf is None:
            return None
        return _added(lr * buf, f"lr {lr:g} x momentum buffer {buf:.6g}", param, index)
    return None


def _adam(group: dict, state: dict, param: torch.Tensor, index: tuple[int, ...],
          lr: float) -> str | None:
    m = _at(state, "exp_avg", index)
    v = _at(state, "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq", index)
    t = _at(state, "step", ())
    if m is None or v is None or t is None:
        return None
    beta1, beta2 = (float(b) for b in group["betas"])
    eps = float(group["eps"])
    denom = math.sqrt(v) / math.sqrt(1 - beta2 ** t) + eps if v >= 0 else math.nan
    said = (f"Adam's update (t = {int(t)}) divides exp_avg {m:.6g} by sqrt(exp_avg_sq "
            f"{v:.6g}) / sqrt(1 - beta2^t) + eps {eps:g} = {denom:.6g}")
    if denom == 0:
        made = "0/0 = NaN" if m == 0 else "x/0 = inf"
        return (f"{said}: {made} (the second moment is 0 where no gradient reached the element "
                f"since the state was made, and eps is 0: keep eps > 0, 1e-8 is 0 in float16)")
    term = lr / (1 - beta1 ** t) * m / denom
    return _added(term, said, param, index)


def _added(term: float, said: str, param: torch.Tensor, index: tuple[int, ...]) -> str:
    """The update `term` subtracted from a finite weight: what the element's value says."""
    value = float(param.detach()[index].double())
    dtype = str(param.dtype).removeprefix("torch.")      # the weight's own limit, not float32's
    if not math.isfinite(term) or abs(term) > torch.finfo(param.dtype).max:
        return f"{said}: the update {term:.6g} overflows {dtype}"
    if math.isnan(value):
        return (f"!the update rule evaluated from the state gives a finite update {term:.6g}, "
                f"which cannot make the NaN the run saw from a finite weight")
    return (f"{said}: a finite update {term:.6g} whose sum with the weight overflowed {dtype} "
            f"(the weight was already near the {dtype} limit: divergence)")
