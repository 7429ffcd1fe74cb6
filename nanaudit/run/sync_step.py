"""The sync read: one optimizer step (a batch, or an accumulation window of micro-batches) read
once, before its update.

The optimizer only runs after that read says all is finite, so a trip leaves the pre-step state
intact for the replay. The post-update weights are checked at the next step's read (or at the
end), which attributes a bad update to the step that made it without a second sync. Under a
GradScaler, non-finite gradients are a skipped step, not a trip (see precision.py); under
torchrun the read carries every rank's flags (check/rank_row.py), so all ranks decide alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.batch import float_leaves, move
from nanaudit.run.check.rank_row import RankTable, rank_row, readout_values
from nanaudit.run.check.verdict import tripped_check
from nanaudit.run.checks import StepReadout, batch_finite, confirm_norms
from nanaudit.run.precision import ScaleStep
from nanaudit.run.step import (
    RngState,
    StepState,
    StepUndo,
    Trip,
    current_lr,
    timeline_entry,
)
from nanaudit.run.step_context import StepContext, StepResult
from nanaudit.run.units import lr_problem
from nanaudit.run.watch_readout import ReadoutExtras


@dataclass
class MicroBatch:
    """One micro-batch of a window (the whole batch of a standard step) and its start state."""

    batch: Any
    rng: RngState
    buffers: list | None                # the BufferKeeper slot saved before its forward
    index: int                          # its data index


class SyncStep:
    """The step read at once: forward and backward of each micro-batch, the one read, the
    verdict, and the update when all is finite."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self._device = torch.device("cpu")    # the step values' device (the exchange's)

    def run(self, step: int, raws: list[Any], last: bool, updated: bool,
            first_index: int | None = None) -> StepResult:
        """One optimizer step under the sentinels. `last`: no step follows (under torchrun no
        batch is fetched ahead); `updated`: an update ran since the weights were last read."""
        ctx = self.ctx
        if ctx.coord is not None and ctx.coord.terminated:
            raise KeyboardInterrupt      # torchrun is stopping the group: partial report
        started = time.perf_counter()
        first_index = ctx.feed.fetched - len(raws) if first_index is None else first_index
        micros, leaves, loss = self._forward_backward(raws, first_index, step)
        scale = ctx.precision.scale if ctx.precision.scaler is not None else None
        # The batch, the weights as this step's forward found them (a bad last update shows
        # here) and this step's gradients, in one fused reduction.
        state = ctx.checks.state_before(micros[0].buffers)
        readout = ctx.checks.step_readout(loss, leaves, state)
        read, table, extras = self._read(readout, loss, last, leaves)
        batch_norm, norm, loss_value, gnorm = readout.read(read)
        summed = gnorm                  # the float32 norm `grad_clip` scales by, as read
        # The common case, all finite, needs nothing confirmed or classified.
        all_finite = math.isfinite(batch_norm + norm + loss_value + gnorm)
        inputs_ok = True
        if not all_finite:
            inputs_ok = batch_finite(batch_norm, leaves)
            norm, gnorm = confirm_norms(ctx.checks, norm, gnorm, state)
        if scale is not None:
            gnorm = gnorm / scale
        trip = (None if all_finite and table is None else
                self._classify(step, table, inputs_ok, norm, loss_value, gnorm, updated))
        lr = current_lr(ctx.optimizer)
        trip, scaler_step, applied = self._advance(step, trip, norm, readout, scale,
                                                   loss_value, gnorm, updated)
        if applied and ctx.session.options.grad_clip and not math.isfinite(summed):
            ctx.watches.clip_overflowed(step)   # finite gradients (no trip), clipped to 0
        used = len(readout) + (RankTable.size(len(table.rows)) if table is not None else 0)
        fields = ctx.watches.observe(step, read[used:], ctx.outcome.timeline,
                                      loss_value, gnorm, extras)
        ctx.outcome.timeline.append(timeline_entry(step, loss_value, gnorm, norm,
                                                    ctx.optimizer, started, scale, scaler_step,
                                                    lr=lr, **fields))
        # Counted with its timeline entry: a stop signal between the two would leave a
        # partial report whose step count and timeline disagree.
        ctx.outcome.steps_run = step + 1
        # An applied update leaves the weights unread until the next step's read.
        updated = updated or applied
        if trip is None:
            return StepResult.of(None, None, updated)
        first = micros[0].buffers
        return StepResult.tripped(
            ctx, trip, lambda: self._trip_state(trip, micros, scale), updated,
            lambda: StepUndo(RngState.capture(), ctx.buffers.pairs(first) if first else None))

    def _forward_backward(self, raws: list[Any], first_index: int, step: int
                          ) -> tuple[list[MicroBatch], list[torch.Tensor], torch.Tensor]:
        """Every micro-batch's forward and backward, keeping what a replay of each needs;
        returns (micro-batch states, all batch leaves, the window's mean loss)."""
        ctx = self.ctx
        micros: list[MicroBatch] = []
        leaves: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        ctx.watches.activations.begin(step)
        for i, raw in enumerate(raws):
            rng = RngState.capture()
            saved = ctx.buffers.save() if ctx.has_buffers else None
            batch = move(raw, ctx.session.device, leaves)
            loss = ctx.unit.forward_backward(
                batch, zero_grad=ctx.checks.zero_grad if i == 0 else None)
            micros.append(MicroBatch(batch, rng, saved, first_index + i))
            losses.append(loss)
        if len(losses) == 1:
            return micros, leaves, losses[0]    # the loss itself: the readout detaches it
        total = losses[0].detach()
        for more in losses[1:]:
            total = total + more.detach()
        return micros, leaves, total / len(losses)

    def _read(self, readout: StepReadout, loss: torch.Tensor, last: bool,
              leaves: list[torch.Tensor]) -> tuple[list[float], RankTable | None, ReadoutExtras]:
        """The one host sync of the step: the fixed values, the exchanged rank table (torchrun)
        and the watches' sampled values, in one tensor. Returns (the values read, the rank
        table or None, what the watches appended)."""
        ctx = self.ctx
        parts = [readout.values]
        self._device = readout.values.device
        if ctx.coord is not None:
            exhausted = ctx.feed.fetch_ahead(last)
            parallel = ctx.coord.parallel
            row = rank_row(readout_values(readout, loss, leaves),
                           parallel.own_gradient_flag(readout.grad_norm),
                           parallel.partial_flag(readout.values.device), exhausted=exhausted)
            parts.append(ctx.coord.exchange(row).reshape(-1))
        extra, extras = ctx.watches.extra_readout()
        values = torch.cat(parts + extra) if len(parts) + len(extra) > 1 else parts[0]
        read = ctx.coord.read(values) if ctx.coord is not None else values.tolist()
        ctx.outcome.host_syncs += 1
        if ctx.coord is None:
            return read, None, extras
        table = RankTable.from_read(read[len(readout):], ctx.coord.world_size)
        return read, table, extras

    def _classify(self, step: int, table: RankTable | None, inputs_ok: bool, norm: float,
                  loss_value: float, gnorm: float, updated: bool) -> Trip | None:
        """The verdict from this process's values, or under torchrun from the rank table (the
        same on every rank): the first rank whose own batch, loss or local gradients went bad
        is the one the finding names."""
        updated_at = step - 1 if updated else None
        if table is None:
            verdict = tripped_check(step, inputs_ok=inputs_ok, weights_finite=math.isfinite(norm),
                                    updated_at=updated_at, loss_finite=math.isfinite(loss_value),
                                    grads_finite=math.isfinite(gnorm))
            return Trip.found(verdict, loss_value, gnorm) if verdict is not None else None
        if table.exhausted():
            self.ctx.feed.stop_after_this_step()
        # FSDP2: each rank reads its own shards, and every rank must decide alike.
        sharded = self.ctx.coord is not None and self.ctx.coord.sharded
        confirmed: dict = {"weights_finite": math.isfinite(norm),
                           "reduced_finite": math.isfinite(gnorm)}
        if sharded and table.doubts_state():       # every rank's shards, confirmed
            assert self.ctx.coord is not None
            confirmed = self.ctx.coord.confirmed(**confirmed, device=self._device)
        verdict = table.verdict(step, updated_at=updated_at, sharded=sharded, **confirmed)
        if verdict is None:
            return None
        return Trip.found(verdict, loss_value, gnorm, rank=verdict.part)

    def _advance(self, step: int, trip: Trip | None, norm: float, readout: StepReadout,
                 scale: float | None, loss_value: float,
                 gnorm: float, updated: bool) -> tuple[Trip | None, ScaleStep | None, bool]:
        """The update, when the read said all is finite; under a GradScaler, non-finite
        gradients are a skipped step unless the scale collapsed. Returns (trip, scaler_step,
        whether the update ran)."""
        ctx = self.ctx
        precision, optimizer = ctx.precision, ctx.optimizer
        if trip is not None and trip.check == Check.GRADIENT and precision.scaler is not None:
            scaler_step = precision.after_readout(ctx.optimizers, grads_finite=False)
            precision.finish_update(ctx.optimizers)
            if scaler_step is not None and scaler_step.collapsed:
                return Trip(step, Check.GRADIENT, loss_value, gnorm, note=scaler_step.collapsed,
                            rank=trip.rank), scaler_step, False
            return None, scaler_step, False
        if trip is not None or optimizer is None:
            return trip, None, False
        # Without a scheduler nothing of nanaudit's moves the lr: one check, at the first update.
        problem = lr_problem(ctx.session) if (ctx.session.schedulers
                                              or not updated) else None
        if problem:
            return Trip(step, Check.SCHEDULE, loss_value, gnorm, note=problem), None, False
        scaler_step = None
        if precision.scaler is not None:
            scaler_step = precision.after_readout(ctx.optimizers, grads_finite=True)
        if ctx.session.options.grad_clip:
            total = readout.grad_norm()
            total = total / scale if scale is not None else total
            ctx.checks.clip_(total, ctx.session.options.grad_clip)
        ctx.watches.updates.measure(step, lambda: ctx.unit.update(loss_value), lambda: norm)
        if precision.scaler is not None:
            precision.finish_update(ctx.optimizers)
        return None, scaler_step, True

    def _trip_state(self, trip: Trip, micros: list[MicroBatch], scale: float | None
                    ) -> StepState:
        """The state a replay starts from: the whole step's, or in a window, the micro-batch
        that made the bad value."""
        index = self._first_bad_micro(trip, micros) if len(micros) > 1 else 0
        micro = micros[index]
        if len(micros) > 1:
            trip.micro_batch = index
        return StepState(trip.step, micro.batch, micro.rng, scale,
                         buffers=self.ctx.buffers.pairs(micro.buffers) if micro.buffers else None,
                         batch_index=micro.index,
                         micro_batch=index if len(micros) > 1 else None, window=len(micros))

    def _first_bad_micro(self, trip: Trip, micros: list[MicroBatch]) -> int:
        """The micro-batch of a window that made the bad value, from each one's inputs, or for
        a loss or gradient by running the window again one micro-batch at a time from its
        start state: the first whose loss or accumulated gradients are non-finite made it
        (syncs: only after a trip)."""
        if trip.check == Check.INPUT:
            for i, micro in enumerate(micros):
                if any(not bool(torch.isfinite(t).all()) for _, t in float_leaves(micro.batch)):
                    return i
        if trip.check in (Check.LOSS, Check.GRADIENT):
            ctx = self.ctx
            unit, checks = ctx.unit, ctx.checks
            for i, micro in enumerate(micros):
                if micro.buffers:
                    ctx.buffers.restore(micro.buffers)
                micro.rng.restore()
                loss = unit.forward_backward(micro.batch, zero_grad=checks.zero_grad if i == 0
                                             else None)
                if not bool(torch.isfinite(loss.detach())) or \
                        not math.isfinite(float(checks.grad_norm())):
                    return i
        return 0
