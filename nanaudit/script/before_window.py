"""A value the in-process replay received already non-finite from the script's own code before
the step's first model call: a tensor the loss code reads (a distillation target made under
`no_grad` from a frozen teacher), or a weight the script changed in place between steps (a
hand-written EMA's `mul_`). The replay runs the step's model calls and recorded loss code only,
so the walk back ends at such a value as if no torch op had made it ("created outside torch
ops"); naming the op that merely passed it on would be wrong, and so would blaming numpy, a C
extension or divergence. The re-run traces the code that made it (before_rerun.py).

A batch the model received already bad is not this: that is the input trip's (data_window.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.localize.producer import arrival_at
from nanaudit.localize.walk import Localization
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import Check, RerunStatus
from nanaudit.run.step_record import ModelCall
from nanaudit.script.target import ScriptOptions
from nanaudit.script.trip import ScriptTrip


def made_before_window(tracer: Any, loc: Localization, calls: list[ModelCall],
                       step: int) -> str | None:
    """Why `loc` cannot be named in-process (its walk ended at a value made before the step's
    first model call, not one of the calls' inputs); None when it can."""
    if loc.event is None:
        return None
    found = carriers(tracer, loc)
    if not found:
        return None
    inputs = {id(t) for call in calls for t in tensors_in((call.args, call.kwargs))}
    params = {id(p): f"{type(call.module).__name__}.{name}" for call in calls
              for name, p in _state(call.module)}
    constants = _loss_constants(calls)
    for t in found:
        if id(t) in inputs:
            continue
        if id(t) in params:
            what = f"the model's tensor {params[id(t)]} was already non-finite when the step began"
        elif id(t) in constants:
            what = ("a tensor the loss code reads (a target, a mask, a teacher's output) was "
                    "already non-finite when the loss code got it")
        else:
            continue
        return (f"{what}: the script's own code made it before step {step}'s first model "
                f"call (its code between the previous update and the model call, or an "
                f"in-place change of weights between steps), which the in-process replay does "
                f"not trace; the re-run traces that code")
    return None


def traces_before(replay: Rerun | None, options: ScriptOptions, trip: ScriptTrip,
                  ranks: Any, model_called: bool = True) -> bool:
    """Whether the re-run also traces the script's code before step N's first model call:
    the in-process replay saw the value enter the step from it, or `--rerun` forced the re-run
    of a loss or gradient trip (no replay looked), or no module was called in step N at all
    (the script called a layer's `forward` itself: its own code made the loss); outside
    torchrun, where the window is not built for the ranks' data code."""
    if replay is not None and replay.status == RerunStatus.MADE_BEFORE:
        return True
    return (options.force_rerun or not model_called) \
        and trip.check in (Check.LOSS, Check.GRADIENT) and not trip.in_buffers and ranks is None


def carriers(tracer: Any, loc: Localization) -> list[torch.Tensor]:
    """The tensors that carried the bad value into the replayed ops, untraced."""
    events = [loc.event] + [e for e in loc.chain or [] if e is not loc.event]
    found: list[torch.Tensor] = []
    for event in events:
        if event is None or not event.untracked:
            continue
        arrival = arrival_at(tracer, event, "any")
        if arrival is not None:
            found.extend(t for t in arrival.carriers if isinstance(t, torch.Tensor))
    return found


def _state(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors among a pytree's leaves (a call's arguments, a model's output)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _loss_constants(calls: list[ModelCall]) -> set[int]:
    """The tensors the recorded loss code read that neither the model nor the loss code made."""
    made: set[int] = set()
    read: set[int] = set()
    for call in calls:
        made.update(id(t) for t in tensors_in(call.output))
        for op in call.code.ops:
            read.update(id(t) for t in tensors_in((op.args, op.kwargs)) if id(t) not in made)
            made.update(id(t) for t in tensors_in(op.out))
    return read
