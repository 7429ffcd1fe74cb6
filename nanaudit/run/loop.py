"""The step loop: seeded training steps under cheap sentinels, stopping before a bad update.

Each step reads the device once: the loss and the per-tensor norms of the batch, the weights
(as the previous update left them) and the gradients travel together in one small tensor, with
the early-warning values appended when there are any (watch_readout.py). How a step is read is
its strategy: the sync read (sync_step.py, the standard step and accumulation windows), the
deferred read (deferred_step.py: CUDA with a fused optimizer; under --keep-going too) and the
checks inside the user's own step (gated_step.py, `step:`). This module drives them: the data,
the steps, and the last read of the weights after the final update.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from nanaudit.errors import ConfigError, Problem, call_user
from nanaudit.report.vocabulary import Check
from nanaudit.run.check.decision import StepDecision
from nanaudit.run.checks import StepChecks, confirm_norms
from nanaudit.run.deferred import BufferKeeper, ReadMode, choose_read
from nanaudit.run.deferred_step import DeferredStep
from nanaudit.run.feed import DATA_END, DataFeed
from nanaudit.run.gated_step import GatedStep
from nanaudit.run.session import Session
from nanaudit.run.step import RngState, ScanOutcome, StepState, Trip
from nanaudit.run.step_context import StepContext, StepResult
from nanaudit.run.sync_step import SyncStep
from nanaudit.run.watch_readout import WatchReadout


def run_steps(session: Session, max_steps: int | None = None, update: bool = True,
              on_step: Callable[[int], None] | None = None, start_step: int = 0,
              stop_on_trip: bool = True, on_trip: Callable | None = None,
              outcome: ScanOutcome | None = None,
              on_skip: Callable[[Trip, StepState], None] | None = None) -> ScanOutcome:
    """Run training steps until data ends, max_steps, or the first non-finite value.

    `start_step` skips that many batches first (resuming from a checkpoint). With
    `stop_on_trip=False` (bisect over a data set, no updates) every tripping batch is passed
    to `on_trip(trip, state)` and the loop goes on. Pass `outcome` to keep the timeline of the
    steps that ran when user code raises; an outcome with a `bad_steps` log keeps going
    (--keep-going): each bad step the check core skips is passed to `on_skip(trip, state)`,
    which localizes it and records it in that log, and the step leaves no trace.
    """
    loop = StepLoop(session, update, outcome if outcome is not None else ScanOutcome())
    if loop.ctx.outcome.bad_steps is not None and on_skip is None:
        raise ValueError("a run that keeps going records each bad step: pass on_skip")
    loop.on_skip = on_skip
    try:
        loop.run(max_steps, start_step, on_step, stop_on_trip, on_trip)
    except KeyboardInterrupt:
        loop.ctx.outcome.interrupted = True
    finally:
        loop.ctx.watches.close()
    return loop.ctx.outcome


def _step_context(session: Session, update: bool, outcome: ScanOutcome) -> StepContext:
    """What the run's steps share, built once."""
    checks = StepChecks(session.model, session.device)
    optimizer = session.optimizer if update else None
    watches = WatchReadout(session, checks.param_values, optimizer is not None)
    outcome.warnings = watches.warnings
    # The sync read keeps the buffers from before each micro-batch's forward: the replay
    # starts from them, and the state check reads them (BatchNorm's statistics change
    # inside the forward).
    return StepContext(session, checks, session.precision, session.coordinator, watches,
                       BufferKeeper(session.local_model, slots=session.unit.window),
                       DataFeed(f"the data from `{session.options.data_label}`"), outcome,
                       optimizer, tuple(session.optimizers.values()))


class StepLoop:
    """One run of the step loop: the data, the steps, and what becomes of each step's result
    (whether an update ran since the weights were last read, the read mode)."""

    def __init__(self, session: Session, update: bool, outcome: ScanOutcome):
        unit = session.unit
        if unit.owns_update and session.coordinator is not None:
            raise ConfigError([Problem("step", "the user's own step (`step:`) runs in one "
                                       "process: under torchrun its checks would have to agree "
                                       "across ranks inside your function; use `loss:`, or "
                                       "`Sentinel` in your DDP loop")])
        self.ctx = ctx = _step_context(session, update, outcome)
        self.updated = False            # has an optimizer step run since the last read?
        self.read = choose_read(session.options.sentinel_read,
                                torch.device(session.device), ctx.optimizer,
                                ctx.precision.scaler, ctx.coord is not None,
                                single_step=(unit.window == 1
                                             and not unit.owns_update
                                             and len(session.optimizers) <= 1
                                             and not session.schedulers))
        self.window = unit.window
        self.on_skip: Callable[[Trip, StepState], None] | None = None

    def run(self, max_steps: int | None, start_step: int,
            on_step: Callable[[int], None] | None, stop_on_trip: bool,
            on_trip: Callable | None) -> None:
        ctx, feed = self.ctx, self.ctx.feed
        if not stop_on_trip and self.read.mode == "deferred":
            self.read = ReadMode("sync", "every tripping batch is reported (bisect)")
        sync = SyncStep(ctx)
        deferred = (DeferredStep(ctx, sync, self.read) if self.read.mode == "deferred"
                    else None)
        gated = GatedStep(ctx) if ctx.unit.owns_update else None
        ctx.outcome.read_mode = self.read
        # A second read of the data (naming the op that made a bad batch) starts from here.
        ctx.outcome.data_rng = RngState.capture()
        data = ctx.session.make_data()
        feed.iterator = call_user(f"iterating {feed.what}", iter, data)
        for _ in range(start_step * self.window):
            if feed.fetch() is DATA_END:
                break
        step = start_step
        while max_steps is None or step < start_step + max_steps:
            raws = feed.window(self.window)
            if raws is None:
                break
            last = max_steps is not None and step + 1 >= start_step + max_steps
            if gated is not None:
                result = gated.run(step, raws[0], self.updated)
            elif deferred is not None and self.read.defers:
                result = deferred.run(step, raws[0], self.updated)
            else:
                result = sync.run(step, raws, last, self.updated)
            if not self._act(result, stop_on_trip, on_trip):
                return
            if deferred is not None and deferred.held is not None:
                # Keep-going, deferred: the step after the one just skipped ran on its
                # buffers; it runs again now they are put back (deferred_step.py).
                self._act(deferred.run_again(self.updated), stop_on_trip, on_trip)
            if on_step:
                on_step(step)
            step += 1
        if deferred is not None and not self._act(deferred.finish(), True, on_trip):
            return
        self._final_check()

    def _act(self, result: StepResult, stop_on_trip: bool, on_trip: Callable | None) -> bool:
        """What the loop does with a step's result, in one place: the check core's decision.
        Returns whether the run goes on."""
        self.updated = result.updated
        if result.read is not None:
            self.read = result.read
        match result.decision:
            case StepDecision.APPLY:
                return True
            case StepDecision.SKIP:
                self._skip(result)
                return True
            case StepDecision.STOP if stop_on_trip:
                outcome = self.ctx.outcome
                outcome.trip, outcome.state = result.trip, result.state
                outcome.stop_reason = result.stop_reason
                return False
            case StepDecision.STOP:   # bisect: every tripping batch, go on
                if on_trip is not None:
                    on_trip(result.trip, result.state)
                return True

    def _skip(self, result: StepResult) -> None:
        """A bad step under keep-going: its update never ran; it is localized and recorded
        now (`on_skip`), then its RNG streams and buffers are put back (`StepUndo`), so the
        next step starts as if this one had not been taken. The next step's first micro-batch
        clears the gradients, as every step does; the schedulers were not stepped (a skipped
        step is no step for them, as DeepSpeed and Megatron skip an overflowing one)."""
        assert result.trip is not None and result.state is not None and result.undo is not None
        assert self.on_skip is not None, "run_steps checks that a keep-going run has on_skip"
        try:
            self.on_skip(result.trip, result.state)
        finally:
            result.undo.restore()

    def _final_check(self) -> None:
        """The weights after the last update (the only read outside a step)."""
        ctx = self.ctx
        if self.updated:
            final, _ = confirm_norms(ctx.checks, float(ctx.checks.state_norm()), 0.0)
            ctx.outcome.host_syncs += 1
            if not math.isfinite(final):
                trip = ctx.outcome.trip = Trip(ctx.outcome.steps_run - 1, Check.OPTIMIZER)
                ctx.outcome.stop_reason = ctx.decide(trip)[1]
        ctx.watches.finish(ctx.outcome.timeline)
