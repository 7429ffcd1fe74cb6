"""Replaying a step `Sentinel` stopped: the session over the user's own loop objects, and the
search of an accumulation window for the micro-batch whose gradients went bad.

The user's loop has no config, so the replay builds its Session from what the Sentinel holds,
with the precision of a loop nanaudit does not drive: autocast is the user's (inside `loss_fn`
or the model), and the loss is scaled by the step's recorded scale.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.checks import confirm_nonfinite
from nanaudit.run.step import StepState, Trip

if TYPE_CHECKING:
    from nanaudit.integrations.sentinel import MicroBatch, Sentinel
    from nanaudit.run.session import Session


class ReplayPrecision:
    """The Session's precision for a Sentinel replay: autocast is the user's, and a replay
    backpropagates the loss times the step's recorded scale."""

    def __init__(self, scaler):
        self.name = "fp32"
        self.scaler = scaler
        self.scale = 1.0

    @staticmethod
    def autocast():
        return contextlib.nullcontext()

    def scaled(self, loss: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return loss * scale if scale is not None else loss


def replay_session(sentinel: Sentinel) -> Session:
    """The Session a replay of the sentinel's step runs in."""
    from nanaudit.run.session import Session
    return Session.for_loop(sentinel.model, sentinel.optimizer,
                            sentinel.loss_fn or (lambda model, batch: None), sentinel.device,
                            label="<Sentinel>", precision=ReplayPrecision(sentinel.scaler))


def search_window(sentinel: Sentinel, session: Session, trip: Trip, window: list[MicroBatch],
                  scale: float | None) -> tuple[int | None, str | None]:
    """The first micro-batch whose own gradients reproduce the non-finite accumulated ones
    (untraced replays, one per micro-batch until found). Returns (index, note); `replaying`
    names the micro-batch being replayed, for the integrations."""
    from nanaudit.localize.replay import preserved_buffers, replay_reproduces
    with preserved_buffers(sentinel.model):
        for i, micro in enumerate(window):
            sentinel.replaying = micro
            state = StepState(trip.step, micro.batch, micro.rng, scale)
            if replay_reproduces(session, state, micro.batch, Check.GRADIENT):
                return i, None
        if len(window) > 1 and _accumulated_reproduces(sentinel, window, scale):
            return None, (f"each of the {len(window)} micro-batches alone gives finite "
                          f"gradients, their accumulated sum does not: it overflowed")
    return None, None


def _accumulated_reproduces(sentinel: Sentinel, window: list[MicroBatch],
                            scale: float | None) -> bool:
    """Do the window's gradients, accumulated again, come out non-finite?"""
    from nanaudit.errors import call_user
    from nanaudit.run.step import scalar_loss
    model = sentinel.model
    model.zero_grad(set_to_none=True)
    for micro in window:        # the user's loss raising here is their error, not a verdict
        sentinel.replaying = micro
        micro.rng.restore()
        loss = scalar_loss(call_user("loss_fn (replaying the accumulation window)",
                                     sentinel.loss_fn, model, micro.batch))
        call_user("backward of the loss", (loss * scale if scale is not None else loss)
                  .backward)
    return confirm_nonfinite([p.grad.detach() for p in model.parameters() if p.grad is not None])
