"""`nanaudit run`'s in-process localization of an error trip: the script raised with non-finite
values in its frames (`torch.multinomial` on NaN probabilities, BCELoss refusing a NaN input,
the script's own `assert torch.isfinite(loss)`). The step record (run/step_record.py) holds the
window's model calls up to the raise and the loss code each recorded until then: they are
replayed under the op tracer as a loss trip's are (inprocess.py; a call whose loss reached
backward, with its backward), and the value the script's frames held is walked back to the op
that made it. A step that calls no module (a model of raw tensors) is replayed from its code as
recorded up to the raise (run/step_record.py's code window). Its cost is one step's, whatever
the step's number.

The replay must reproduce what the first run saw before it names anything: each finished
micro-batch's loss; the exception, of the same type, when the first run raised inside what the
replay runs (the model's forward, which never returned, or a recorded backward) and none
elsewhere; and the frames' tensors the model or the loss code made, non-finite again. The sink
walked back from is the first of those (the innermost frame's); else the non-finite tensors in
the replay's own exception frames (a forward that raised); else the last non-finite value the
tracer saw, as the re-run names it (child.localize_raised). A value the replay does not make at
all was made by the data code, which only the re-run traces: it falls back, saying why. Under
torchrun the raising rank replays alone (DDP's local module) while its peers wait in a
collective it never joins; what it cannot replay alone is refused, never re-run
(error_ranks.py)."""

from __future__ import annotations

from typing import Any

import torch

from nanaudit.localize.events import kinds_of
from nanaudit.localize.findings import event_precision
from nanaudit.localize.replay_finding import finding_at, raised_sink, walk_raised
from nanaudit.localize.tracer import OpTracer
from nanaudit.report.model import Finding
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import Where
from nanaudit.run.step_record import ModelCall
from nanaudit.script.code_batch import window_place
from nanaudit.script.error_ranks import forward_alone
from nanaudit.script.inprocess import (
    Replayed,
    replay_call,
    replay_tracer,
    timed_replay,
    window_params,
)
from nanaudit.script.replayable import NotReplayable, replay_allowed, replayable
from nanaudit.script.step_values import loss_mismatch
from nanaudit.script.target import ScriptOptions
from nanaudit.script.trip import ScriptTrip, nonfinite_locals


def localize_error(auditor: Any, options: ScriptOptions, trip: ScriptTrip,
                   timeline: Any) -> tuple[Rerun | None, Finding | None]:
    """(the replay's record, the finding it names; None: fall back to the re-run, the record's
    note says why)."""
    def replayed() -> Replayed:
        calls, forward = _window(auditor, options, trip)
        return _replayed(auditor, calls, trip, timeline, forward)
    return timed_replay(replayed)


def _window(auditor: Any, options: ScriptOptions,
            trip: ScriptTrip) -> tuple[list[ModelCall], bool]:
    """(the window's calls, whether their forwards are replayed: under torchrun a rank whose
    forward needs its peers replays the loss code alone, error_ranks.py)."""
    replay_allowed(options)
    record = auditor.hooks.tap.record
    calls = list(record.calls)
    if not calls and record.code_window is not None:
        calls = [record.code_window]    # a step that calls no module: its code so far
    if not calls and record.evaluated is not None:
        # before the step's first call, after the trained model's latest evaluation (a
        # sample drawn between steps): that call and the code after it up to the raise
        calls = [record.evaluated]
    if not calls:
        raise NotReplayable(f"the script raised before any model call of step {trip.step}")
    forward = True
    if auditor.ranks is not None:       # torchrun: this rank replays alone (error_ranks.py)
        forward = forward_alone(auditor.ranks, calls)
    for call in calls[:-1]:
        replayable(call)
    if calls[-1].output is not None or not calls[-1].model_called:
        # else its forward raised: replayed up to the raise
        replayable(calls[-1])
    return calls, forward


def _replayed(auditor: Any, calls: list[ModelCall], trip: ScriptTrip, timeline: Any,
              forward: bool = True) -> Replayed:
    """(the finding or None, the ops traced, the creating op's precision or why not)."""
    env: dict[int, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    raised: Exception | None = None
    record = auditor.hooks.tap.record
    evaluation = calls[0] is record.evaluated
    with auditor.hooks.muted(), record.replaying(window_params(auditor, calls),
                                                 evaluation) as writable, torch.enable_grad():
        tracer = replay_tracer(auditor, calls)
        ends: list[int] = []        # the tracer's events after each call
        with tracer:
            try:
                for call in calls:
                    pairs += replay_call(tracer, call, None, env, forward=forward,
                                         writable=writable)
                    ends.append(len(tracer.trace.events))
            except NotReplayable:
                raise
            except Exception as exc:        # the script's own code raising again: verified
                raised = exc
        ops = tracer.trace.ops_seen
        why = loss_mismatch(pairs) or _other_raise(raised, calls[-1], trip)
        if why is not None:
            return None, ops, why
        sink = _sink(tracer, env, auditor.error_values, raised)
        if isinstance(sink, str):
            return None, ops, sink
        return _named(tracer, sink, (calls, ends), trip, timeline, ops)


def _other_raise(raised: Exception | None, last: ModelCall, trip: ScriptTrip) -> str | None:
    """Why the replay's exception (or its lack) is not the first run's; None: it is."""
    kind = trip.error.split(":", 1)[0]
    # A step's own code (no module called) raised in an op its record never kept (it kept
    # only what returned) or in Python (`assert`): its replay runs no raising code.
    inside = ((last.output is None and last.model_called) or trip.where == Where.BACKWARD)
    if raised is None:
        return (f"the in-process replay of the step did not raise the run's {kind}"
                if inside else None)
    said = f"{type(raised).__name__}: {str(raised)[:200]}"
    if not inside:
        return (f"the in-process replay raised {said} in code where the run raised nothing")
    if type(raised).__name__ != kind:
        return f"the in-process replay raised {said} where the run raised {trip.error}"
    return None


def _sink(tracer: OpTracer, env: dict[int, torch.Tensor], held: list[torch.Tensor],
          raised: Exception | None) -> torch.Tensor | str:
    """The replay's non-finite value to walk back from (see the module docstring), or why
    there is none."""
    mapped = [env[id(t)] for t in held if id(t) in env]
    if any(not kinds_of(t) for t in mapped):
        return ("the in-process replay made finite a tensor the script's frames held "
                "non-finite: a non-deterministic op, or state the step reads outside the "
                "model's parameters and buffers")
    again: list[torch.Tensor] = []
    if raised is not None:
        nonfinite_locals(raised, held=again)
    sink = raised_sink(tracer, [*mapped, *again])
    return sink if sink is not None else (
        "no op of the replayed model or loss code made the non-finite value the script held: "
        "the data code made it")


def _named(tracer: OpTracer, sink: torch.Tensor, window: tuple[list[ModelCall], list[int]],
           trip: ScriptTrip, timeline: Any, ops: int) -> Replayed:
    loc = walk_raised(tracer, sink, timeline)
    if not loc.reproduced or loc.event is None:
        return None, ops, "the in-process replay named no op that made the value"
    batch, micro = window_place(*window, loc.event.index, raised=True)
    finding = batch.told(finding_at(tracer, loc, trip.step, None, batch.size))
    finding.micro_batch = micro
    finding.tensor = trip.tensors[0] if trip.tensors else None    # the frame's, as the run saw
    return finding, ops, event_precision(loc.event)
