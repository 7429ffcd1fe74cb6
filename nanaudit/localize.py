"""Replay the step that tripped a sentinel with full instruments and build the finding.

The replay restores the RNG state captured before the step and the model's buffers, runs
forward, loss and backward under the OpTracer, then walks back from the value that tripped (the
loss, or a parameter's gradient) to the op that created it. If the replay comes out finite the
finding says `reproduced: false` and names no op: a guess is never presented as the answer
(after Megatron's rerun state machine, which tells a transient fault from a bug the same way).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from nanaudit.diagnose import Diagnosis, diagnose
from nanaudit.loader import Session
from nanaudit.runner import StepState, Trip, forward_backward
from nanaudit.sentinels import Sentinels, value_kind
from nanaudit.stats import tensor_stats
from nanaudit.tracer import OpEvent, OpTracer, Trace, kinds_of, named_tensors, walk_back


@contextlib.contextmanager
def preserved_buffers(model: torch.nn.Module):
    """Restore buffers (BatchNorm running stats) after each replay, so replays stay comparable."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@dataclass
class Localization:
    reproduced: bool
    kind: str | None = None               # the sink's value kind: nan, inf, -inf
    event: OpEvent | None = None          # the creating op
    chain: list | None = None             # creating op ... op that reached the sink
    diagnosis: Diagnosis | None = None
    bad_tensors: list | None = None       # parameter names with non-finite gradients
    ops_traced: int = 0


def traced_replay(session: Session, state: StepState) -> tuple[Trace, torch.Tensor]:
    state.rng.restore()
    with OpTracer(session.model) as tracer:
        loss = forward_backward(session, state.batch, before_backward=tracer.start_backward,
                                scale=state.scale)
    return tracer.trace, loss


def replay_reproduces(session: Session, state: StepState, batch, check: str) -> bool:
    """An untraced replay on `batch`: does the same check trip again? (for sample isolation)"""
    state.rng.restore()
    try:
        loss = forward_backward(session, batch, scale=state.scale)
    except Exception:  # noqa: BLE001 - a sub-batch the model cannot take does not reproduce
        return False
    if check == "loss":
        return not bool(torch.isfinite(loss.detach()))
    return not bool(torch.isfinite(Sentinels(session.model, session.device).grad_norm()))


def localize(session: Session, state: StepState, trip: Trip, timeline) -> Localization:
    with preserved_buffers(session.model):
        trace, loss = traced_replay(session, state)
    if trip.check == "loss":
        return _from_sink(trace, loss, "forward", timeline, None)
    bad = [(name, p) for name, p in session.model.named_parameters()
           if p.grad is not None and kinds_of(p.grad)]
    if not bad:
        return Localization(False, ops_traced=trace.ops_seen)
    return _from_sink(trace, bad[0][1].grad, "backward", timeline, [n for n, _ in bad])


def _last_event(trace: Trace, phase: str) -> int | None:
    for event in reversed(trace.events):
        if event.phase == phase:
            return event.index
    return trace.events[-1].index if trace.events else None


def _from_sink(trace: Trace, sink: torch.Tensor, phase: str, timeline, names) -> Localization:
    kinds = kinds_of(sink)
    if not kinds:
        return Localization(False, ops_traced=trace.ops_seen)
    value = value_kind(sink)
    start = trace.producer_of(sink)
    start = start if start is not None else _last_event(trace, phase)
    if start is None:
        return Localization(False, ops_traced=trace.ops_seen)
    kind = "nan" if "nan" in kinds else "inf"
    event, chain = walk_back(trace, start, kind)
    diagnosis = diagnose(event, kind, timeline, trace)
    if diagnosis.cause == "inf-arithmetic":
        event, chain, diagnosis = _follow_infinity(trace, event, chain, diagnosis, timeline)
    return Localization(True, value, event, chain, diagnosis, names, trace.ops_seen)


def _follow_infinity(trace, event, chain, diagnosis, timeline):
    """NaN from infinities: if an op upstream made the inf for a specific reason, blame it."""
    for kinds, producer in zip(event.in_kinds, event.in_producers):
        if producer is None or not kinds & {"inf", "-inf"}:
            continue
        origin, upstream = walk_back(trace, producer, "inf")
        found = diagnose(origin, "inf", timeline, trace)
        if found.cause not in ("unknown", "inf-arithmetic", "dtype-overflow"):
            text = (f"{found.explanation}; the infinity then reached "
                    f"{event.op.split('.')[1]}, which turned it into NaN")
            return origin, upstream + chain, Diagnosis(found.cause, text, found.fix)
    return event, chain, diagnosis


def input_stats(event: OpEvent) -> list:
    return [tensor_stats(name, t) for name, t in named_tensors(event.arg_names, event.args,
                                                                event.kwargs)]


def forward_input_stats(event: OpEvent) -> list:
    record = event.forward
    if record is None or record.args is None:
        return []
    return [tensor_stats(name, t) for name, t in named_tensors(record.arg_names, record.args,
                                                                record.kwargs)]
