"""What a step strategy of the loop is given and what it gives back, below the loop and its
strategies (sync_step.py, gated_step.py, deferred_step.py) so that neither imports the other.

A strategy takes a `StepContext` (the run's session, checks, precision, coordinator, watches,
buffers, data feed and outcome; fixed for the run) and whether an update ran since the weights
were last read, and returns a `StepResult`: what it found, the check core's decision on the
step, and whether an update has run since that read now. It writes nothing of the loop; the
loop acts on the decision in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.run.check.decision import StepDecision
from nanaudit.run.checks import StepChecks
from nanaudit.run.deferred import BufferKeeper, ReadMode
from nanaudit.run.distributed import Coordinator
from nanaudit.run.feed import DataFeed
from nanaudit.run.precision import Precision
from nanaudit.run.session import Session
from nanaudit.run.step import ScanOutcome, StepState, Trip
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

    @classmethod
    def of(cls, trip: Trip | None, state: StepState | None, updated: bool,
           read: ReadMode | None = None) -> StepResult:
        """The result whose decision the check core gives for `trip`."""
        return cls(trip, state, updated, StepDecision.of(trip), read)
