"""The user's own step (`step:`), checked at a gate before each optimizer step it makes.

The user's function decides when to update, so the read cannot come after its backward: each
optimizer step inside the call first passes a gate (units.py stops the call there when it
says no), which reads that optimizer's weights, gradients and the losses backpropagated since
the last gate in one sync. A trip stops the call before that update; the updates the call
made before it are put back, so the replay starts from the state before the call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.batch import move
from nanaudit.run.check.verdict import tripped_check
from nanaudit.run.checks import StepChecks, batch_finite, confirm_norms
from nanaudit.run.step import (
    RngState,
    StepState,
    StepUndo,
    Trip,
    current_lr,
    timeline_entry,
)
from nanaudit.run.step_context import StepContext, StepResult
from nanaudit.run.units import lr_problem, step_schedulers
from nanaudit.run.user_step import UpdatePoint, UserRun


@dataclass
class GateReads:
    """What the gates inside one call of the user's step have seen."""

    leaves: list
    buffers: list | None
    checked: bool = False
    loss: float | None = None
    norm: float = 0.0
    gnorm: float = 0.0
    trip: Trip | None = None


class GatedStep:
    """One call of the user's step per loop step, read at each of its optimizer steps."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.checks: dict = {}          # id(optimizer) -> StepChecks over its params
        # Optimizers that have updated at least once: their weights were finite at every gate
        # before, so weights non-finite at a gate were made by their last update.
        self.stepped: set[int] = set()

    def run(self, step: int, raw_batch: object, updated: bool) -> StepResult:
        """One call of the user's `step:` function. `updated`: an update ran since the weights
        were last read."""
        ctx = self.ctx
        if ctx.coord is not None and ctx.coord.terminated:
            raise KeyboardInterrupt
        started = time.perf_counter()
        rng = RngState.capture()
        saved = ctx.buffers.save() if ctx.has_buffers else None
        leaves: list = []
        batch = move(raw_batch, ctx.session.device, leaves)
        ctx.watches.activations.begin(step)
        seen = GateReads(leaves, saved)
        lr = current_lr(ctx.optimizer)
        run = ctx.unit.run(batch, lambda point: self._gate(step, point, seen))
        if run.halted is None:
            seen.trip = self._returned_losses(step, run, seen)
        if seen.trip is None and run.updates and ctx.session.schedulers:
            step_schedulers(ctx.session.schedulers, seen.loss)
        ctx.outcome.timeline.append(timeline_entry(step, seen.loss, seen.gnorm, seen.norm,
                                                    ctx.optimizer, started, lr=lr))
        ctx.outcome.steps_run = step + 1           # with its timeline entry
        updated = updated or run.updates > 0
        if seen.trip is None:
            return StepResult.of(None, None, updated)
        for put_back in reversed(run.undo):
            put_back()                   # the updates this call made before the bad one
        trip = seen.trip
        return StepResult.tripped(ctx, trip, lambda: StepState(
            step, batch, rng, buffers=ctx.buffers.pairs(saved) if saved else None,
            batch_index=ctx.feed.fetched - 1,
            halt_at=run.halted.index if run.halted else None, undo=run.undo), updated,
            lambda: StepUndo(RngState.capture(), ctx.buffers.pairs(saved) if saved else None))

    def _gate(self, step: int, point: UpdatePoint, seen: GateReads) -> bool:
        """The check before one optimizer step inside the user's step: its parameters as
        their last update left them, its gradients, the losses backpropagated since the last
        check and (at the first) the batch, in one read. True lets the update run."""
        ctx = self.ctx
        checks = self.checks.get(id(point.optimizer))
        if checks is None:
            params = [p for g in point.optimizer.param_groups for p in g["params"]]
            checks = self.checks[id(point.optimizer)] = StepChecks(
                ctx.session.local_model, ctx.session.device, params=params)
        first = not seen.checked
        loss = (torch.stack([t.detach().float().reshape(()) for t in point.losses]).sum()
                if point.losses else torch.zeros((), device=ctx.session.device))
        state = checks.state_before(seen.buffers) if first else checks.param_values
        readout = checks.step_readout(loss, seen.leaves if first else [], state)
        read = readout.values.tolist()
        ctx.outcome.host_syncs += 1
        batch_norm, norm, loss_value, gnorm = readout.read(read)
        inputs_ok = batch_finite(batch_norm, seen.leaves) if first else True
        norm, gnorm = confirm_norms(checks, norm, gnorm, state)
        seen.checked = True
        seen.norm, seen.gnorm = norm, gnorm
        if point.losses and math.isfinite(loss_value):
            seen.loss = loss_value if seen.loss is None else seen.loss + loss_value
        updated = id(point.optimizer) in self.stepped
        verdict = tripped_check(step, inputs_ok=inputs_ok, weights_finite=math.isfinite(norm),
                                updated_at=step - 1 if updated else None,
                                loss_finite=math.isfinite(loss_value),
                                grads_finite=math.isfinite(gnorm))
        trip = Trip.found(verdict, loss_value, gnorm) if verdict is not None else None
        if trip is None:
            problem = lr_problem(ctx.session, only=point.optimizer)
            trip = Trip(step, Check.SCHEDULE, loss_value, gnorm, note=problem) if problem else None
        if trip is None:
            self.stepped.add(id(point.optimizer))
            return True
        trip.optimizer = point.name
        if trip.check == Check.LOSS:
            bad = [i for i, t in enumerate(point.losses) if not bool(torch.isfinite(t).all())]
            if bad and bad[0] < len(point.loss_names):
                trip.loss_name = point.loss_names[bad[0]]
        seen.trip = trip
        return False

    def _returned_losses(self, step: int, run: UserRun, seen: GateReads) -> Trip | None:
        """A returned loss the gates did not see (the step made no update, or never
        backpropagated it): one more read, only then."""
        unseen = {n: t for n, t in run.losses.items()
                  if not (seen.checked and t.requires_grad)}
        if not unseen:
            return None
        values = torch.stack([t.detach().float().reshape(()) for t in unseen.values()]).tolist()
        self.ctx.outcome.host_syncs += 1
        if seen.loss is None:
            seen.loss = sum(values)          # NaN carries, as the standard step shows it
        for name, value in zip(unseen, values):
            if not math.isfinite(value):
                note = ("found after the call's updates (no check before an update saw it): "
                        "the replay starts from the weights they left" if run.updates else None)
                return Trip(step, Check.LOSS, value, seen.gnorm, loss_name=name, note=note)
        return None
