"""The walk back from the value that tripped a sentinel (the loss, or a parameter's gradient) to
the op that created it, and the finding's diagnosis of that op.

It starts at the event that produced the sink, follows the inputs that carried the sink's kind of
value (events.Trace.walk_back), lets the blame decide which op explains it (blame.py), and adds
where the value on the edge came from and whose hand-written backward ran the op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.blame import Blamer, origin_note
from nanaudit.localize.diagnose import Diagnosis
from nanaudit.localize.events import OpEvent, Trace, kinds_of
from nanaudit.report.model import SampleSearch
from nanaudit.report.sections import ShardElement
from nanaudit.report.vocabulary import Where
from nanaudit.run.checks import value_kind


@dataclass
class Localization:
    """What the walk found: the creating op, its chain to the sink and the diagnosis; with
    `reproduced` False (the replay came out finite, or no op made the value) nothing else."""

    reproduced: bool
    kind: str | None = None               # the sink's value kind: nan, inf, -inf
    event: OpEvent | None = None          # the creating op
    chain: list | None = None             # creating op ... op that reached the sink
    diagnosis: Diagnosis | None = None
    bad_tensors: list | None = None       # parameter names with non-finite gradients
    ops_traced: int = 0
    rows: list | None = None              # rows read off the creating op's output, and how
    sample_search: SampleSearch | None = None   # (FSDP2's replays: no sample search)
    element: ShardElement | None = None   # the creating op's sharded output's bad element


def _last_event(trace: Trace, phase: Where) -> int | None:
    for event in reversed(trace.events):
        if event.phase == phase:
            return event.index
    return trace.events[-1].index if trace.events else None


def walk_from_sink(trace: Trace, sink: torch.Tensor, phase: Where, timeline: Any,
                   names: list[str] | None, reached: str | None = None) -> Localization:
    """Localize the bad value `sink` (made in `phase`); `names`: the parameters whose gradients
    are bad, for a gradient sink; `reached`: what the sink is, in words, when it is neither
    the loss nor a gradient (`the buffer q.embed`)."""
    kinds = kinds_of(sink)
    if not kinds:
        return Localization(False, ops_traced=trace.ops_seen)
    value = value_kind(sink)
    start = trace.producer_of(sink)
    start = start if start is not None else _last_event(trace, phase)
    if start is None:
        return Localization(False, ops_traced=trace.ops_seen)
    kind = "nan" if "nan" in kinds else "inf"
    creator, chain = trace.walk_back(start, kind)
    blame = Blamer(trace, timeline, reached).blame(creator, chain, kind)
    diagnosis = blame.diagnosis
    note = origin_note(trace, diagnosis)
    if note:
        diagnosis = Diagnosis(diagnosis.cause, diagnosis.explanation + note, diagnosis.fix)
    if blame.event.function is not None and \
            f"autograd.Function {blame.event.function}" not in diagnosis.explanation:
        where = f" ({os.path.basename(blame.event.source.file)}:{blame.event.source.line})" \
            if blame.event.source is not None else ""
        diagnosis = Diagnosis(diagnosis.cause, f"in the hand-written backward of the "
                              f"autograd.Function {blame.event.function}{where}: "
                              f"{diagnosis.explanation}", diagnosis.fix)
    return Localization(True, value, blame.event, blame.chain, diagnosis, names, trace.ops_seen)
