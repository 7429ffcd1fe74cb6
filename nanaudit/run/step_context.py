"""What a step strategy of the loop is given and what it gives back, below the loop and its
strategies (sync_step.py, gated_step.py, deferred_step.py) so that neither imports the other.

A strategy takes a `StepContext` (the run's session, checks, precision, coordinator, watches,
buffers, data feed and outcome; fixed for the run) and whether an update ran since the weights
were last read, and returns a `StepResult`: what it found, the check core's decision on the
step, and whether an update has run since that read now. It writes nothing of the loop; the
loop acts on the decision in one place. Under keep-going a tripped step's result also carries
what the loop puts back when it skips the step (`StepUndo`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.report.vocabulary import StopReason
from nanaudit.run.check.decision import StepDecision, keep_going
from nanaudit.run.checks import StepChecks
from nanaudit.run.deferred import BufferKeeper, ReadMode
from nanaudit.run.distributed import Coordinator
from nanaudit.run.feed import DataFeed
from nanaudit.run.precision import Precision
from nanaudit.run.session import Session
from nanaudit.run.step import ScanOutcome, StepState, StepUndo, Trip
from nanaudit.run.watch_readout import WatchReadout


@dataclass(frozen=True)
class StepContext:
    """What every step of one run of the loop shares (the objects, not who owns them)."""

    session: Session
    checks: StepChecks                  # the sentinels over the model's parameters
    precision: Precision
    coord: Coordinator | None           # under torchrun
    watches: WatchReadout
    buffers: BufferKeeper               # the buffers before each micro-batch's forward
    feed: DataFeed
    outcome: ScanOutcome                # the timeline, step count and host reads it adds to
    optimizer: torch.optim.Optimizer | None   # None: no updates (bisect)
    optimizers: tuple[torch.optim.Optimizer, ...]

    @property
    def unit(self) -> Any:
        """The step unit (run/units.py): how a batch becomes a loss and an update."""
        return self.session.unit

    @property
    def has_buffers(self) -> bool:
        return bool(self.buffers.buffers)

    def decide(self, trip: Trip) -> tuple[StepDecision, StopReason | None]:
        """The check core's decision on a tripped step: STOP, or under keep-going SKIP until
        skipping cannot help (decision.keep_going). The bad-step count is the run's, the
        same on every rank (each rank records every bad step's finding)."""
        log = self.outcome.bad_steps
        if log is None:
            return StepDecision.STOP, None
        return keep_going(trip.check, log.skipped, log.max_bad_steps)

    @property
    def optimizer_what(self) -> str:
        """The optimizer's step as a message about the user's code names it."""
        return f"optimizer step of `{type(self.optimizer).__name__}`"


@dataclass(frozen=True)
class StepResult:
    """What a strategy decided about a step (or, deferred, about the step before it)."""

    trip: Trip | None
    state: StepState | None             # where a replay of the tripping step starts
    updated: bool                       # has an update run since the weights were last read?
    decision: StepDecision
    read: ReadMode | None = None        # the read mode from now on, when this step changed it
    stop_reason: StopReason | None = None   # keep-going: why a STOP stops the run
    undo: StepUndo | None = None        # SKIP: what the loop puts back after the replays

    @classmethod
    def of(cls, trip: Trip | None, state: StepState | None, updated: bool,
           read: ReadMode | None = None) -> StepResult:
        """The result whose decision the check core gives for `trip`."""
        return cls(trip, state, updated, StepDecision.of(trip), read)

    @classmethod
    def tripped(cls, ctx: StepContext, trip: Trip, state_of: Callable[[], StepState],
                updated: bool, undo_of: Callable[[], StepUndo]) -> StepResult:
        """The result of a tripped step as `ctx` decides it. `undo_of` is taken (only for a
        SKIP) before `state_of`, whose search of a window runs micro-batches again."""
        decision, reason = ctx.decide(trip)
        undo = undo_of() if decision == StepDecision.SKIP else None
        return cls(trip, state_of(), updated, decision, stop_reason=reason, undo=undo)
