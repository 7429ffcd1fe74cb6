"""Replay the step that tripped a sentinel: once with full instruments to name the op, and
untraced on sub-batches for the sample search.

The replay restores the RNG state captured before the step and the model's buffers, runs
forward, loss and backward under the OpTracer, then walks back from the value that tripped (the
loss, or a parameter's gradient) to the op that created it. If the replay comes out finite the
finding says `reproduced: false` and names no op: a guess is never presented as the answer
(after Megatron's rerun state machine, which tells a transient fault from a bug the same way).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nanaudit.localize.events import kinds_of
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.localize.weight_growth import OptimizersWeights
from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.checks import StepChecks
from nanaudit.run.names import user_named
from nanaudit.run.session import Session
from nanaudit.run.step import ReplayHooks, StepState, Trip


@contextlib.contextmanager
def preserved_buffers(model: torch.nn.Module) -> Any:
    """Restore buffers (BatchNorm running stats) on exit, so replays stay comparable; yields
    the restore, for a caller that runs several replays from the same buffers."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    try:
        yield restore
    finally:
        restore()


def traced_replay(session: Session, state: StepState,
                  weights: OptimizersWeights | None = None) -> tuple[OpTracer, torch.Tensor]:
    """The step unit's replay of the tripping (micro-)step under the OpTracer; `weights`: who
    updated the model's parameters (weight_growth.py)."""
    with OpTracer(session.model, weights=weights) as tracer:
        loss = session.unit.replay(state, hooks=ReplayHooks(tracer.start_backward,
                                                            tracer.end_backward))
    return tracer, loss


def replay_reproduces(session: Session, state: StepState, batch: Any, check: Check) -> bool:
    """An untraced replay on `batch`: does the same check trip again? (for sample isolation)

    An exception of the user's code is raised as their UserCodeError, never read as "does not
    reproduce": the sample search keeps sub-batches to sizes the model takes (samples.Feeding),
    so what is left is the user's to see."""
    loss = session.unit.replay(state, batch)
    if check == Check.LOSS:
        return not bool(torch.isfinite(loss.detach()))
    return not bool(torch.isfinite(StepChecks(session.model, session.device).grad_norm()))


def rows_the_model_needs(model: torch.nn.Module) -> tuple[int, str]:
    """The fewest rows a replay's batch must have for the model to take it, and why: BatchNorm
    in train mode needs more than one value per channel (a 1-row batch of (N, C) features
    raises). Other limits (a model that fixes its batch size) show as an exception, which the
    sample search answers by feeding the full batch size."""
    norms = [name or type(m).__name__ for name, m in user_named(model, model.named_modules())
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        shown = ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else "")
        return 2, (f"BatchNorm in train mode ({shown}) needs more than one value per channel")
    return 1, ""


def session_weights(session: Session, trip: Trip, timeline: Any) -> OptimizersWeights:
    """Who updated the model's weights before the trip: the session's optimizers, each stepped
    at the step before it (unless the user's own step decides), from the weights' norm at the
    timeline's first step, checked before its update (none before the trip: no update yet)."""
    first = next(iter(timeline), None)
    norm = first.param_norm if first is not None and first.step < trip.step else None
    return OptimizersWeights(session.optimizers, {id(p): n for n, p in user_named(
        session.model, session.model.named_parameters())}, norm,
        trip.step - 1 if session.step_fn is None else None)


def localize(session: Session, state: StepState, trip: Trip, timeline: Any) -> Localization:
    """Replay the tripping step traced and walk back from what tripped: the loss, or the first
    parameter whose gradient is non-finite."""
    with preserved_buffers(session.model):
        tracer, loss = traced_replay(session, state, session_weights(session, trip, timeline))
    trace = tracer.trace
    if trip.check == Check.LOSS:
        return walk_from_sink(trace, loss, Where.FORWARD, timeline, None)
    model = session.model
    bad = [(name, p) for name, p in user_named(model, model.named_parameters())
           if p.grad is not None and kinds_of(p.grad)]
    if not bad:
        return Localization(False, ops_traced=trace.ops_seen)
    return walk_from_sink(trace, bad[0][1].grad, Where.BACKWARD, timeline, [n for n, _ in bad])
