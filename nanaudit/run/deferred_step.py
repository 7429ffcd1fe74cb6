"""The deferred read's step (CUDA with a fused optimizer): each step's readout is read at the
next step, while the device skips any update after a non-finite value (deferred.py).

A step that reads all finite goes into the timeline. One that does not is run again from its
own start with the sync read (sync_step.py), which confirms, classifies and decides. A stop
(or a false alarm, which applies the update) reads synchronously from then on.

Under keep-going a bad step N the check core skips stays deferred. When the host reads step N,
step N+1 has run too and the sticky flag skipped both updates, so the parameters and the
optimizer state are as before N. The loop localizes and skips N from its sync run again (its
buffers go back as before N, its RNG streams as N left them), then `run_again` runs N+1 once
more from its kept RNG state and batch, on those buffers, with the flag cleared: N+1 runs
twice, the first time wasted, counted in `ScanOutcome.steps_run_again` (the report's
`sentinel_read.steps_run_again`). A clean step pays nothing for it: its state is kept for the
deferred read anyway.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanaudit.errors import call_user
from nanaudit.run.batch import move
from nanaudit.run.check.decision import StepDecision
from nanaudit.run.checks import StepReadout
from nanaudit.run.deferred import BufferKeeper, DeviceSkip, HostReader, ReadMode
from nanaudit.run.step import RngState, timeline_entry
from nanaudit.run.step_context import StepContext, StepResult
from nanaudit.run.sync_step import SyncStep
from nanaudit.run.watch_readout import ReadoutExtras


@dataclass
class PendingStep:
    """A deferred step whose readout is still on its way to the host."""

    step: int
    batch: Any
    rng: RngState
    buffers: Any
    readout: StepReadout                # where each value sits
    handle: Any
    extras: ReadoutExtras
    started: float
    ended: float
    updated: bool                       # had an update run before this step's forward?


class DeferredStep:
    """Steps read one step late; a non-finite read rewinds to that step and reads it again
    synchronously (`sync`)."""

    def __init__(self, ctx: StepContext, sync: SyncStep, read: ReadMode):
        if ctx.optimizer is None:       # choose_read defers only an optimizer's update
            raise ValueError("the deferred read needs an optimizer to skip updates")
        self.ctx, self.sync, self.optimizer, self.read = ctx, sync, ctx.optimizer, read
        device = ctx.session.device
        self.skip = DeviceSkip(device)
        self.keeper = BufferKeeper(ctx.session.local_model)
        self.reader = HostReader(torch.device(device))
        self.pending: PendingStep | None = None
        self.held: PendingStep | None = None     # keep-going: the step to run again

    def run(self, step: int, raw_batch: object, updated: bool) -> StepResult:
        """One training step whose readout is read at the next step (or at the end); the
        device skips the update if any of its values is non-finite. Returns the previous
        step's result. `updated`: an update ran since the weights were last read."""
        started = time.perf_counter()
        return self._launch(step, raw_batch, RngState.capture(), updated, started)

    def run_again(self, updated: bool) -> StepResult:
        """Keep-going: the step after a skipped one, once more from its kept RNG state and
        batch, now that the loop has put the skipped step's buffers back (the module
        docstring). Nothing is pending, so its result is the step's own launch."""
        held, self.held = self.held, None
        assert held is not None, "run_again follows a skipped step"
        self.ctx.outcome.steps_run_again += 1
        held.rng.restore()
        return self._launch(held.step, held.batch, held.rng, updated, time.perf_counter())

    def _launch(self, step: int, raw_batch: object, rng: RngState, updated: bool,
                started: float) -> StepResult:
        """Queue a step's forward, backward, readout and flagged update; settle the one
        before it."""
        ctx = self.ctx
        leaves: list = []
        batch = move(raw_batch, ctx.session.device, leaves)
        saved = self.keeper.save()
        ctx.watches.activations.begin(step)
        loss = ctx.unit.forward_backward(batch, zero_grad=ctx.checks.zero_grad)
        readout = ctx.checks.step_readout(loss, leaves, ctx.checks.state_before(saved))
        self.skip.note(readout.values)
        if ctx.session.options.grad_clip:
            ctx.checks.clip_(readout.grad_norm(), ctx.session.options.grad_clip)
        optimizer = self.optimizer
        ctx.watches.updates.measure(step, lambda: self.skip.step(
            optimizer, lambda: call_user(ctx.optimizer_what, optimizer.step)),
            readout.state_norm)
        extra, extras = ctx.watches.extra_readout()
        values = readout.values
        handle = self.reader.send(torch.cat([values, *extra]) if extra else values)
        previous, self.pending = self.pending, PendingStep(
            step, batch, rng, saved, readout, handle, extras, started, time.perf_counter(),
            updated)
        if previous is None:
            return StepResult.of(None, None, updated=True)
        return self._settle(previous, self.pending)

    def finish(self) -> StepResult:
        """Read the last step, at the end of the run."""
        if self.pending is None:
            return StepResult.of(None, None, updated=True)
        result = self._settle(self.pending, None)
        self.pending = None
        return result

    def _settle(self, previous: PendingStep, current: PendingStep | None) -> StepResult:
        """Read a deferred step. All finite: it goes into the timeline. Otherwise the device
        skipped its update and every one since: put the buffers and the RNG back, and run that
        step again with the synchronous read. A skip (keep-going) stays deferred and holds the
        step after it for `run_again`; a stop or a false alarm reads the rest of the run
        synchronously (the result's read mode says from which step)."""
        ctx = self.ctx
        read = self.reader.receive(previous.handle)
        ctx.outcome.host_syncs += 1
        batch_norm, norm, loss_value, gnorm = previous.readout.read(read)
        if math.isfinite(batch_norm + norm + loss_value + gnorm):
            fields = ctx.watches.observe(previous.step, read[len(previous.readout):],
                                         ctx.outcome.timeline,
                                         loss_value, gnorm, previous.extras)
            ctx.outcome.timeline.append(timeline_entry(
                previous.step, loss_value, gnorm, norm, ctx.optimizer, previous.started,
                ended=previous.ended, **fields))
            ctx.outcome.steps_run = previous.step + 1    # with its timeline entry
            return StepResult.of(None, None, updated=True)
        self.pending = None
        self.skip.clear()
        self.keeper.restore(previous.buffers)
        previous.rng.restore()
        again = self.sync.run(previous.step, [previous.batch], last=False,
                              updated=previous.updated,
                              first_index=ctx.feed.fetched - 1 - (current is not None))
        if again.decision == StepDecision.SKIP:
            self.held = current
            return again
        self.read = replace(self.read, sync_from=previous.step)
        ctx.outcome.read_mode = self.read
        if again.trip is None and current is not None:
            current.rng.restore()            # a false alarm: the next step again, in order
            again = self.sync.run(current.step, [current.batch], last=False,
                                  updated=again.updated)
        return replace(again, read=self.read)
