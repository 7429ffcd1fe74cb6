"""The findings stated from what the step's check saw, before (or without) a replay: one builder
for every front end (`scan`'s loop, `Sentinel`, `nanaudit run`).

A bad batch, bad weights or optimizer state, buffers a forward made bad, a loss or gradients no
replay traced, an error raised among non-finite values: each front end says what it saw, in
its own words and with what it knows (`Seen`: the loop holds the batch and the model, the
script auditor the names, shapes and rows its hooks read), and `first_finding` decides, once,
where the finding sits, its cause and its fix from the check that tripped. The localized
finding of a traced replay is `findings.traced_finding`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nanaudit.localize.causes import fix_for
from nanaudit.report.model import Finding, SampleRow, TensorStats
from nanaudit.report.vocabulary import Cause, Check, Where


@dataclass(frozen=True)
class Seen:
    """What a front end saw of a trip, without a replay."""

    step: int
    check: Check
    value: str                          # the kind of the first bad value: nan, inf, -inf
    explanation: str                    # what was seen, in the front end's words
    tensors: Sequence[str] = ()         # every tensor involved (batch paths, parameters)
    tensor: str | None = None           # the one named; None: the first of `tensors`
    samples: list[int] | None = None    # the batch's bad rows, when its layout is known
    inputs: Sequence[TensorStats] = ()  # statistics of the bad tensors
    sample_rows: Sequence[SampleRow] = ()
    rank: int | None = None
    in_forward: bool = False            # buffers the step's forward made bad
    parameters: bool = True             # OPTIMIZER: parameters (not only buffers) went bad
    where: Where | None = None          # an error's frame, when it names one
    optimizer: str | None = None


def first_finding(seen: Seen) -> Finding:
    """The finding of what was seen: where, cause and fix by the check that tripped."""
    where, cause = _where_and_cause(seen)
    tensor = seen.tensor if seen.tensor is not None else next(iter(seen.tensors), None)
    return Finding(step=seen.step, where=where, value=seen.value, cause=cause,
                   explanation=seen.explanation, fix=fix_for(cause), tensor=tensor,
                   samples=seen.samples, inputs=list(seen.inputs),
                   sample_rows=list(seen.sample_rows), tensors=list(seen.tensors),
                   rank=seen.rank, optimizer=seen.optimizer)


def _where_and_cause(seen: Seen) -> tuple[Where, Cause]:
    """A bad batch is the input's; bad weights after an update the optimizer's (a bad lr is,
    before it); bad weights before it, or only buffers, the state's. A loss, gradients, a
    forward's buffers or an error, not traced, have no cause yet: their phase is known."""
    if seen.check == Check.INPUT:
        return Where.INPUT, Cause.NONFINITE_INPUT
    if seen.in_forward:
        return Where.FORWARD, Cause.UNKNOWN
    if seen.check == Check.SCHEDULE or (seen.check == Check.OPTIMIZER and seen.parameters):
        return Where.OPTIMIZER, Cause.OPTIMIZER_UPDATE
    if seen.check in (Check.OPTIMIZER, Check.PARAMETER):
        return Where.PARAMETER, Cause.NONFINITE_PARAMETER
    if seen.where is not None:
        return seen.where, Cause.UNKNOWN
    return (Where.FORWARD if seen.check == Check.LOSS else Where.BACKWARD), Cause.UNKNOWN


def short(items: Iterable[object], limit: int = 10) -> str:
    """`[a, b, ...]`: the first `limit` items of a list a finding names (every front end's)."""
    shown = list(items)
    return "[" + ", ".join(map(str, shown[:limit])) + (", ..." if len(shown) > limit else "") + "]"
