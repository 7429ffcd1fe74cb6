"""The op of an update trip (script/update_replay.py): torch.optim's own update of the bad
parameter's group, run again under the op tracer on one-element copies of the bad element, so
that the op named is the one the optimizer's implementation choice runs (single-tensor
`aten.addcdiv_`, foreach `aten._foreach_addcdiv_`, fused `aten._fused_adam_`), not a guess.

The copies stand for the update's inputs, which are gone (update_replay.py says why): the
optimizer's state after the step as the state before it (its step count one back, so the bias
corrections are the step's own), a finite weight 0 and a gradient 0 (the gradient of an element
no batch reached; one no state keeps). That keeps what made the value where the state holds it
(a zero denominator stays 0, a moment's sign stays its own, an inf learning rate scales the
same quotient); the first op whose output held a non-finite value is named only when the copy
ends with the kind of value the run saw (NaN, inf or -inf), else why not is said.

The update is torch's step function itself, called past torch's step wrapper (so neither the
script's nor nanaudit's step hooks run) on a shallow copy of the optimizer (made without its
`__init__` or `__setstate__`) holding only the copies: the script's tensors, state and hooks are
not touched. Only torch.optim's own classes are run: a subclass's step is the script's code.
The inputs the finding shows are the state the rule read (the moments, the accumulator) over
the whole parameter: a read per tensor, at the trip only."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.stats import tensor_stats
from nanaudit.localize.tracer import OpTracer
from nanaudit.run.checks import value_kind
from nanaudit.script.update_rules import state_read

Index = tuple[int, ...]


@dataclass(frozen=True)
class UpdateOp:
    """The op the update ran that made the value (None: not named, and `note` says why)."""

    op: str | None
    note: str = ""
    ops: int = 0             # the aten ops the copies' update ran under the tracer


def update_op(optimizer: Any, group: dict, param: torch.Tensor, index: Index,
              kind: str) -> UpdateOp:
    """The op `optimizer`'s update of `group` ran that made `param[index]` (of value `kind`)."""
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return UpdateOp(None, f"{type(optimizer).__name__}'s step is not torch.optim's own: "
                              f"it is not run again")
    step = getattr(type(optimizer).step, "__wrapped__", None)
    if step is None or param.is_complex():
        return UpdateOp(None, "torch's update function could not be run again for this "
                              "parameter")
    copied, clone = _copies(optimizer, group, param, index)
    held = [key for key, value in clone.state[copied].items()
            if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all())]
    if held:
        return UpdateOp(None, f"the optimizer's state after the step is non-finite at the "
                              f"element ({', '.join(held)}): it cannot stand for the state "
                              f"before the step, which is gone, so the update is not run again "
                              f"and the op is not named")
    try:
        with OpTracer(torch.nn.Module()) as tracer:
            step(clone)
    except Exception as error:    # the copy's step is torch's: report it, never raise it
        return UpdateOp(None, f"the update run again on a copy of the element raised "
                              f"{type(error).__name__}: {error}")
    ops = tracer.trace.ops_seen
    made = value_kind(copied) if not bool(torch.isfinite(copied).all()) else "finite"
    if made == "finite":
        return UpdateOp(None, "the update run again on a copy of the element stayed finite "
                              "(its inputs before the step, a weight near its limit, are gone)",
                        ops)
    if made != kind:
        return UpdateOp(None, f"the update run again on a copy of the element made {made}, "
                              f"not the {kind} the run saw: the op is not named", ops)
    return UpdateOp(tracer.trace.events[0].op, ops=ops)    # its inputs were all finite


def _copies(optimizer: Any, group: dict, param: torch.Tensor,
            index: Index) -> tuple[torch.Tensor, Any]:
    """A one-element copy of the element (weight 0, gradient 0) and a shallow copy of
    `optimizer` whose only group and state are the copies (see the module docstring)."""
    element = torch.zeros(1, dtype=param.dtype, device=param.device,
                          requires_grad=param.requires_grad)
    element.grad = torch.zeros_like(element)
    state = {key: _element(key, value, param, index) for key, value in
             optimizer.state.get(param, {}).items()}
    clone = object.__new__(type(optimizer))     # no __init__ nor __setstate__: no side effect
    clone.__dict__.update(optimizer.__dict__)
    clone.state = defaultdict(dict, {element: state})
    clone.param_groups = [{**group, "params": [element], **_implementation(group)}]
    return element, clone


def _element(key: str, value: Any, param: torch.Tensor, index: Index) -> Any:
    """A state entry for the copy: the element of a tensor shaped as the parameter, the step
    count one back, anything else as it is."""
    back = 1 if key == "step" else 0
    if not isinstance(value, torch.Tensor):
        return value - back if isinstance(value, (int, float)) and value >= back else value
    value = value.detach()
    if value.shape == param.shape and value.dim():
        return value[index].reshape(1).clone()
    copied = value.clone()
    if back and copied.numel() == 1 and bool(copied.reshape(()) >= back):
        copied -= back
    return copied


def _implementation(group: dict) -> dict:
    """The group's implementation where torch's default chose it for the group's own
    parameters (`_default_to_fused_or_foreach`, when neither flag was given): a group the
    default keeps off foreach (a tensor subclass, a device without foreach kernels among its
    parameters) runs the copy off foreach too; otherwise the copy, a tensor of the same device
    and dtype, gets torch's own choice."""
    if group.get("foreach") is not None or group.get("fused") or "foreach" not in group:
        return {}
    from torch.optim.optimizer import _default_to_fused_or_foreach
    params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
    _, foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable")))
    return {} if foreach else {"foreach": False}


def state_inputs(optimizer: Any, group: dict, param: torch.Tensor) -> list:
    """The statistics of the state the rule read, over the whole parameter."""
    state = optimizer.state.get(param, {})
    return [tensor_stats(key, state[key]) for key in state_read(optimizer, group)
            if isinstance(state.get(key), torch.Tensor)]
