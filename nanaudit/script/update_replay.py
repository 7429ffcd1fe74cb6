"""`nanaudit run`'s in-process account of an update trip (Check.OPTIMIZER: the optimizer's step
made a parameter non-finite from finite gradients), at the trip, with no re-run.

The check that trips reads the weights before the NEXT step's update, so the update's inputs
(the weights, gradients and state before it) are gone: torch's optimizers update in place, and
keeping them would be a per-step copy of the weights, which the leave-on path never makes. No
replay of the update's ops is sound from what is left, and none is attempted (inverting an
update is not sound either: `exp_avg.lerp_` rounds, and the gradient is overwritten by the next
backward).

What is left is exact where it matters (script/update_rules.py, each of torch.optim's rules):
Adam's, AdamW's, Adamax's and RAdam's moments after the step are the very values its update
divided, and SGD's momentum buffer after the step is its update (`lr * buf`); RMSprop's,
Adagrad's, NAdam's and Adadelta's denominators are read from their state too, their numerator
being the gradient. So at the parameter's first non-finite element the rule is evaluated again
from the optimizer's own state and hyper-parameters (float64, one element, one read) and what
made the value is named: a non-finite learning rate; a zero denominator (eps 0 over an
accumulator no gradient has reached) making 0/0 or x/0, with the eps to give as the fix; a
quotient that overflowed; or a finite update whose sum with the weight overflowed. A term that
cannot have made the value the run saw is not believed. A term whose numerator is the gradient
(overwritten since) and a non-zero denominator, other optimizers (a subclass too: its step may
differ), SGD without momentum, a sharded (DTensor) parameter and a
hand-written update keep the first run's finding, and the record says why.

Where the rule explains the element, the finding names as for any other op: the op, from
torch's own update run on one-element copies standing for the update's inputs and checked
against the run's value (update_op.py: not a replay of the step, and said to be none where it
does not hold); the script's line that called the step and the one that built the optimizer
(call_sites.py); the module holding the parameter; the state the rule read as the op's inputs."""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.report.model import Finding
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import RerunStatus
from nanaudit.run.sharded import is_sharded
from nanaudit.script.call_sites import where
from nanaudit.script.inprocess import IN_PROCESS
from nanaudit.script.trip import ScriptTrip, float_kind
from nanaudit.script.update_op import state_inputs, update_op
from nanaudit.script.update_rules import EVALUATED, Division, evaluate


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
    built = auditor.ledger.sites.built_line(optimizer)
    at = f" at {where(built)}" if built is not None else ""
    rule = _rule(optimizer, group, optimizer.state.get(param, {}), param, index, at)
    if rule is None:
        return Rerun(status=RerunStatus.SKIPPED, note=(
            f"the update rule of {type(optimizer).__name__} is not evaluated in-process at "
            f"this element (torch.optim's {EVALUATED} are, from their state after the step, "
            f"where it holds the update or the zero it divided by; SGD without momentum's "
            f"update is the gradient, overwritten since)"))
    if rule.text.startswith("!"):
        return Rerun(steps=1, duration_s=round(time.perf_counter() - started, 3),
                     status=RerunStatus.NOT_REPRODUCED, note=rule.text[1:])
    finding.explain(f"at {name}{list(index)}{_rows(param, name)}: {rule.text}")
    if built is not None:
        finding.explain(f"{type(optimizer).__name__} was built{at} (`{built.code}`)")
    if rule.fix is not None:
        finding.fix = rule.fix
    traced = _name_the_op(auditor, finding, optimizer, group, param, index, name)
    finding.localized_by = IN_PROCESS
    return Rerun(steps=1, duration_s=round(time.perf_counter() - started, 3),
                 status=RerunStatus.REPRODUCED, ops_traced=traced)


def _name_the_op(auditor: Any, finding: Finding, optimizer: Any, group: dict,
                 param: torch.Tensor, index: tuple[int, ...], name: str) -> int:
    """The finding's op (verified on copies: update_op.py), the script's line that called the
    step, the module holding the parameter and the state the rule read; returns the ops the
    copies' update ran."""
    kind = float_kind(float(param.detach()[index].double()))
    named = update_op(optimizer, group, param, index, kind)
    finding.op = named.op
    if named.op is None:
        finding.explain(named.note)
    finding.source = auditor.ledger.sites.step_line(optimizer)
    finding.module = None if name.startswith("<") else name.rpartition(".")[0]
    finding.inputs = state_inputs(optimizer, group, param)
    return named.ops


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


def _rule(optimizer: Any, group: dict, state: dict, param: torch.Tensor,
          index: tuple[int, ...], at: str) -> _Said | None:
    """What made the element, from the optimizer's state after the step; None: not evaluated
    for this optimizer (or this element); a text starting with "!": the state cannot have made
    it."""
    lr = float(group["lr"])
    if not math.isfinite(lr):
        return _Said(f"the learning rate is {lr}: every update it scales is non-finite")
    division = evaluate(optimizer, group, state, index)
    if division is None:
        return None
    if division.denominator == 0:
        return _zero_denominator(optimizer, group, division, param, index, at)
    if division.term is None:
        return None            # its numerator, the step's gradient, is gone by the check
    return _Said(_added(division.term, division.said, param, index))


@dataclass(frozen=True)
class _Said:
    """The clause that explains the element, and a fix where the rule names one."""

    text: str
    fix: str | None = None


def _zero_denominator(optimizer: Any, group: dict, division: Division, param: torch.Tensor,
                      index: tuple[int, ...], at: str) -> _Said:
    zero = division.numerator_zero
    if zero is None:           # the numerator is gone: the value the run saw says which
        zero = math.isnan(float(param.detach()[index].double()))
    made = "0/0 = NaN" if zero else "x/0 = inf"
    eps = float(group.get("eps", 0.0))
    name = type(optimizer).__name__
    default = inspect.signature(type(optimizer).__init__).parameters.get("eps")
    usual = (f" (its default {default.default:g})" if default is not None
             and isinstance(default.default, float) else "")
    dtype = str(param.dtype).removeprefix("torch.")
    if eps and float(torch.tensor(eps, dtype=param.dtype)) == 0:     # eps rounds to 0 there
        return _Said(
            f"{division.said}: {made} (the {division.accumulator} is 0 where no gradient "
            f"reached the element since the state was made, and eps {eps:g} is 0 in {dtype})",
            f"keep {name}'s state in float32 (a float32 master copy of the weights, or the "
            f"model in float32 under autocast){at}, or an eps of at least {dtype}'s smallest "
            f"normal, {torch.finfo(param.dtype).smallest_normal:g}: eps {eps:g} is 0 in "
            f"{dtype}, so an element no gradient has reached divides by 0")
    return _Said(
        f"{division.said}: {made} (the {division.accumulator} is 0 where no gradient reached "
        f"the element since the state was made, and eps is {eps:g})",
        f"give {name} a positive eps{usual}{at}: with eps {eps:g} an element no gradient has "
        f"reached divides by 0")


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
