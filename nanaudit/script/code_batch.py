"""The batch a replayed window's rows are counted in. A model call's is its first tensor
argument's leading size (step_values.leading_size). A step that calls no module (a model of raw
tensors) has no call arguments: its batch is the data its trained computation read, that is
every tensor an op of its recorded code read into a differentiable value which is itself no
trainable tensor (a DataLoader's yielded batch and targets, a batch drawn by `torch.randn`, a
frozen encoder's features); their leading sizes must agree. Where they do not (a constant table
of another size beside the batch), or no such tensor has a dimension, the batch is not named
and the finding says why instead of counting rows in a guessed one. Read at a trip only. And
the micro-batch of an accumulation window a replayed value was made in: the one whose call ran
the op the finding names (the tracer numbers its events in order, and a replay counts them
after each call)."""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.report.model import Finding, SampleSearch
from nanaudit.run.step_record import ModelCall
from nanaudit.script.step_values import leading_size


class StepBatch(NamedTuple):
    """The window's batch size (None: not known) and, for a step's code, why it is not."""

    size: int | None
    why_not: str | None = None

    def told(self, finding: Finding) -> Finding:
        """`finding`, saying why its rows are not named when the batch was not identified."""
        if self.why_not is not None and not finding.samples:
            finding.sample_search = SampleSearch(None, 0, False,
                                                 f"no rows named: {self.why_not}")
        return finding


def step_batch(call: ModelCall) -> StepBatch:
    """The batch of a replayed window whose first call is `call` (see the module docstring)."""
    if call.model_called:
        return StepBatch(leading_size(call.args, call.kwargs))
    sizes = sorted({int(t.shape[0]) for t in _data_read(call)})
    if len(sizes) == 1:
        return StepBatch(sizes[0])
    if not sizes:
        return StepBatch(None, "the step calls no module, and its differentiable ops read no "
                               "data tensor with a batch dimension")
    shown = ", ".join(map(str, sizes[:6]))
    return StepBatch(None, f"the step calls no module, and the data its differentiable ops "
                           f"read has leading sizes {shown}: which is the batch is not known")


def _data_read(call: ModelCall) -> list[torch.Tensor]:
    """The tensors with a dimension, trained by nothing, that a recorded op read into a
    differentiable value."""
    data: dict[int, torch.Tensor] = {}
    for op in call.code.ops:
        if not any(isinstance(o, torch.Tensor) and o.requires_grad
                   for o in tree_flatten(op.out)[0]):
            continue
        for t in tree_flatten((op.args, op.kwargs))[0]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and not t.requires_grad
                    and not isinstance(t, torch.nn.Parameter)):
                data.setdefault(id(t), t)
    return list(data.values())


def micro_batch(calls: list[ModelCall], index: int, raised: bool = False) -> int | None:
    """The accumulation window's micro-batch of model call `index`: how many backward calls
    the window made before it (a model called once a token before one backward is one
    micro-batch). None: the window is one backward, no accumulation. `raised`: the window's
    last call raised before its own backward (counted as one: it was a micro-batch too)."""
    before = sum(bool(call.code.roots) for call in calls[:index])
    backwards = sum(bool(call.code.roots) for call in calls) + int(
        raised and not calls[-1].code.roots)
    return before if backwards >= 2 else None


def window_place(calls: list[ModelCall], ends: list[int], event: int,
                 raised: bool = False) -> tuple[StepBatch, int | None]:
    """(the batch the rows of tracer event `event` are counted in, its micro-batch), `ends[i]`
    being the number of events the replay had seen when call i ended (a call that raised has
    no end: the event is the one after the last end; `raised`: an error trip's window, whose
    last call raised, as micro_batch says). The batch is the first call's of the
    event's micro-batch (a recurrent window's later calls take a hidden state first)."""
    index = min(bisect_right(ends, event), len(calls) - 1)
    micro = micro_batch(calls, index, raised)
    first = 0 if micro is None else max(
        (i + 1 for i in range(index) if calls[i].code.roots), default=0)
    return step_batch(calls[first]), micro
