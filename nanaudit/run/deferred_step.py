"""The deferred read's step (CUDA with a fused optimizer): each step's readout is read at the
next step, while the device skips any update after a non-finite value (deferred.py).

A step that reads all finite goes into the timeline. One that does not is run again from its
own start with the sync read (sync_step.py), which confirms, classifies and, for a false alarm,
applies the update; from then on the run reads synchronously.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from nanaudit.errors import call_user
from nanaudit.run.batch import move
from nanaudit.run.checks import StepReadout
from nanaudit.run.deferred import BufferKeeper, DeviceSkip, HostReader
from nanaudit.run.step import RngState, timeline_entry
from nanaudit.run.sync_step import SyncStep
from nanaudit.run.watch_readout import ReadoutExtras

if TYPE_CHECKING:
    from nanaudit.run.loop import StepLoop


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

    def __init__(self, loop: StepLoop, sync: SyncStep):
        if loop.optimizer is None:       # choose_read defers only an optimizer's update
            raise ValueError("the deferred read needs an optimizer to skip updates")
        self.loop, self.sync, self.optimizer = loop, sync, loop.optimizer
        device = loop.session.device
        self.skip = DeviceSkip(device)
        self.keeper = BufferKeeper(loop.session.local_model)
        self.reader = HostReader(torch.device(device))
        self.pending: PendingStep | None = None

    def run(self, step: int, raw_batch):
        """One training step whose readout is read at the next step (or at the end); the
        device skips the update if any of its values is non-finite. Returns the previous
        step's (trip, state), or (None, None)."""
        loop = self.loop
        started = time.perf_counter()
        updated = loop.updated
        rng = RngState.capture()
        leaves: list = []
        batch = move(raw_batch, loop.session.device, leaves)
        saved = self.keeper.save()
        loop.watches.activations.begin(step)
        loss = loop.unit.forward_backward(batch, zero_grad=loop.sentinels.zero_grad)
        readout = loop.sentinels.step_readout(loss, leaves, loop.sentinels.state_before(saved))
        self.skip.note(readout.values)
        if loop.session.options.grad_clip:
            loop.sentinels.clip_(readout.grad_norm(), loop.session.options.grad_clip)
        optimizer = self.optimizer
        loop.watches.updates.measure(step, lambda: self.skip.step(
            optimizer, lambda: call_user(loop.optimizer_what, optimizer.step)),
            readout.state_norm)
        loop.updated = True
        extra, extras = loop.watches.extra_readout()
        values = readout.values
        handle = self.reader.send(torch.cat([values, *extra]) if extra else values)
        previous, self.pending = self.pending, PendingStep(
            step, batch, rng, saved, readout, handle, extras, started, time.perf_counter(),
            updated)
        if previous is None:
            return None, None
        return self._settle(previous, self.pending)

    def finish(self):
        """Read the last step, at the end of the run: (trip, state) or (None, None)."""
        if self.pending is None:
            return None, None
        trip, state = self._settle(self.pending, None)
        self.pending = None
        return trip, state

    def _settle(self, previous: PendingStep, current: PendingStep | None):
        """Read a deferred step. All finite: it goes into the timeline. Otherwise the device
        skipped its update and every one since: put the buffers and the RNG back, and run that
        step again with the synchronous read; then the step after it, and the rest of the run,
        read synchronously too."""
        loop = self.loop
        read = self.reader.receive(previous.handle)
        loop.outcome.host_syncs += 1
        batch_norm, norm, loss_value, gnorm = previous.readout.read(read)
        if math.isfinite(batch_norm + norm + loss_value + gnorm):
            fields = loop.watches.observe(previous.step, read[len(previous.readout):],
                                          loop.outcome.timeline,
                                          loss_value, gnorm, previous.extras)
            loop.outcome.timeline.append(timeline_entry(
                previous.step, loss_value, gnorm, norm, loop.optimizer, previous.started,
                ended=previous.ended, **fields))
            loop.outcome.steps_run = previous.step + 1    # with its timeline entry
            return None, None
        self.pending = None
        self.skip.clear()
        self.keeper.restore(previous.buffers)
        previous.rng.restore()
        loop.updated = previous.updated
        loop.read = replace(loop.read, sync_from=previous.step)
        loop.outcome.read_mode = loop.read
        trip, state = self.sync.run(previous.step, [previous.batch], last=False,
                                    first_index=loop.fetched - 1 - (current is not None))
        if trip is not None or current is None:
            return trip, state
        current.rng.restore()            # a false alarm: the next step again, in order
        return self.sync.run(current.step, [current.batch], last=False)
