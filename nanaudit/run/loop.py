"""The step loop: seeded training steps under cheap sentinels, stopping before a bad update.

Each step reads the device once: the loss and the per-tensor norms of the batch, the weights
(as the previous update left them) and the gradients travel together in one small tensor, with
the early-warning values (activation maxima, the last sampled update norm) appended when there
are any. In the sync read the optimizer only runs after that read says all is finite, so a trip
leaves the pre-step state intact for the replay; the post-update parameter norm is checked at
the next step's read (or at the end), which attributes a bad update to the step that made it
without a second sync. In the deferred read (deferred.py: CUDA with a fused optimizer) the
read comes one step later while the device skips bad updates, and a trip rewinds to the bad
step and runs it again with the sync read. Under a GradScaler, non-finite gradients are a
skipped step, not a trip (see precision.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from nanaudit.errors import ConfigError, UserCodeError, call_user
from nanaudit.run.batch import move
from nanaudit.run.checks import StepChecks, confirm_nonfinite
from nanaudit.run.deferred import BufferKeeper, DeviceSkip, HostReader, ReadMode, choose_read
from nanaudit.run.distributed import FLAGS
from nanaudit.run.session import Session
from nanaudit.run.step import (
    RngState,
    ScanOutcome,
    StepState,
    Trip,
    classify_step,
    confirm_norms,
    forward_backward,
    timeline_entry,
)
from nanaudit.run.watch import MAX_WARNINGS, ActivationWatch, GrowthWatch, UpdateWatch


def _next_batch(iterator, what: str):
    """The next batch, or _END when the data is exhausted (under torchrun every rank must
    know before the step's exchange); the user's iterator raising is their error."""
    try:
        return next(iterator)
    except StopIteration:
        return _END
    except (KeyboardInterrupt, UserCodeError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user's generator or DataLoader raised
        raise UserCodeError(what, exc) from exc


@dataclass
class _Extras:
    """Which early-warning values a readout carries after its fixed part, in order."""

    update_step: int | None = None
    update_base: float | None = None    # None: the base norm rides in the readout too
    labels: list | None = None          # the activation watch's labels (None: not sampled)


class _Watches:
    """The early-warning detectors of one run, and where their readout values go."""

    def __init__(self, session: Session, sentinels: StepChecks, updating: bool):
        options = session.config.watch
        every = options.activation_every(session.precision.name)
        self.activations = ActivationWatch(session.local_model, every, options.near_overflow)
        update_every = options.update_every if (updating and options.update_ratio) else 0
        self.updates = UpdateWatch(sentinels.params, update_every, session.device)
        self.growth = GrowthWatch(options)
        self.warnings: list = []

    def extra_readout(self) -> tuple[list[torch.Tensor], _Extras]:
        """The values this step adds to the readout ([update norm (, its base)], [activation
        maxima]) and what they are, for `observe` (which may run a step later)."""
        step, norm, base = self.updates.take()
        act = self.activations.pending()
        extras, parts = _Extras(), []
        if norm is not None:
            extras.update_step = step
            parts.append(norm.reshape(1))
            if isinstance(base, torch.Tensor):       # deferred read: the base is on the device
                parts.append(base.reshape(1))
            else:
                extras.update_base = base
        if act is not None:
            extras.labels = list(self.activations.labels)
            parts.append(act.to(torch.float64))
        return parts, extras

    def observe(self, step: int, extra: list[float], timeline: list, loss, gnorm,
                extras: _Extras) -> dict:
        """Turn the readout's extra values into timeline fields and warnings."""
        fields: dict = {}
        if extras.update_step is not None:
            value = extra.pop(0)
            base = extras.update_base if extras.update_base is not None else extra.pop(0)
            ratio = value / max(base, 1e-30)
            if extras.update_step == step:
                fields["update_ratio"] = ratio
            else:
                self._set_update_ratio(timeline, extras.update_step, ratio)
            self._add(self.growth.observe_update(extras.update_step, ratio))
        if extras.labels is not None:
            self.activations.labels = extras.labels
            act_max, act_ratio, found = self.activations.observe(step, extra)
            fields.update(act_max=act_max, act_ratio=act_ratio)
            self._add(found)
        self._add(self.growth.observe(step, loss, gnorm))
        return fields

    def finish(self, timeline: list) -> None:
        """Read the last sampled update norm (at the end of the run, with the final check)."""
        step, norm, base = self.updates.take()
        if step is not None:
            ratio = float(norm) / max(float(base), 1e-30)
            self._set_update_ratio(timeline, step, ratio)
            self._add(self.growth.observe_update(step, ratio))

    @staticmethod
    def _set_update_ratio(timeline: list, step: int, ratio: float) -> None:
        for entry in reversed(timeline[-2:]):
            if entry.step == step:
                entry.update_ratio = ratio

    def _add(self, found: list) -> None:
        room = MAX_WARNINGS - len(self.warnings)
        self.warnings.extend(found[:max(room, 0)])

    def close(self) -> None:
        self.activations.close()


def run_steps(session: Session, max_steps: int | None = None, update: bool = True,
              on_step: Callable[[int], None] | None = None, start_step: int = 0,
              stop_on_trip: bool = True, on_trip: Callable | None = None,
              outcome: ScanOutcome | None = None) -> ScanOutcome:
    """Run training steps until data ends, max_steps, or the first non-finite value.

    `start_step` skips that many batches first (resuming from a checkpoint). With
    `stop_on_trip=False` (bisect over a data set, no updates) every tripping batch is passed
    to `on_trip(trip, state)` and the loop goes on. Pass `outcome` to keep the timeline of the
    steps that ran when user code raises.
    """
    loop = _StepLoop(session, update, outcome if outcome is not None else ScanOutcome())
    try:
        loop.run(max_steps, start_step, on_step, stop_on_trip, on_trip)
    except KeyboardInterrupt:
        loop.outcome.interrupted = True
    finally:
        loop.watches.close()
    return loop.outcome


@dataclass
class _Pending:
    """A deferred step whose readout is still on its way to the host."""

    step: int
    batch: Any
    rng: RngState
    buffers: Any
    readout: Any                        # its StepReadout: where each value sits
    handle: Any
    extras: _Extras
    started: float
    ended: float
    updated: bool                       # had an update run before this step's forward?


class _StepLoop:
    """One run of the step loop: its sentinels, detectors, and what it has seen so far."""

    def __init__(self, session: Session, update: bool, outcome: ScanOutcome):
        self.session, self.outcome = session, outcome
        self.sentinels = StepChecks(session.model, session.device)
        self.optimizer = session.optimizer if update else None
        self.precision = session.precision
        self.coord = session.coordinator
        self.watches = _Watches(session, self.sentinels, self.optimizer is not None)
        outcome.warnings = self.watches.warnings
        self.updated = False            # has an optimizer step run since the last read?
        self.what = f"the data from `{session.config.data.target}`"
        self.optimizer_what = (f"optimizer step of `{type(self.optimizer).__name__}`"
                               if self.optimizer is not None else "")
        self.iterator = None
        self.ahead = _NOTHING           # under torchrun: the next batch, fetched early
        self.read = choose_read(getattr(session.config, "sentinel_read", "auto"),
                                torch.device(session.device), self.optimizer,
                                self.precision.scaler, self.coord is not None)
        self.pending: _Pending | None = None
        self.skip = self.keeper = self.reader = None

    def run(self, max_steps, start_step, on_step, stop_on_trip, on_trip) -> None:
        if not stop_on_trip and self.read.mode == "deferred":
            self.read = ReadMode("sync", "every tripping batch is reported (bisect)")
        if self.read.mode == "deferred":
            self.skip = DeviceSkip(self.session.device)
            self.keeper = BufferKeeper(self.session.local_model)
            self.reader = HostReader(torch.device(self.session.device))
        self.outcome.read_mode = self.read
        data = self.session.make_data()
        self.iterator = call_user(f"iterating {self.what}", iter, data)
        for _ in range(start_step):
            if self._fetch() is _END:
                break
        step = start_step
        while max_steps is None or step < start_step + max_steps:
            raw_batch = self._fetch()
            if raw_batch is _END:
                break
            last = max_steps is not None and step + 1 >= start_step + max_steps
            if self.read.defers:
                trip, state = self._deferred_step(step, raw_batch)
            else:
                trip, state = self._step(step, raw_batch, last)
            if trip is not None:
                if stop_on_trip:
                    self.outcome.trip, self.outcome.state = trip, state
                    return
                on_trip(trip, state)
            if on_step:
                on_step(step)
            step += 1
        if self.pending is not None:
            trip, state = self._settle(self.pending, None)
            self.pending = None
            if trip is not None:
                self.outcome.trip, self.outcome.state = trip, state
                return
        self._final_check()

    def _fetch(self):
        """The next raw batch, or _END when the data (or, under torchrun, any rank's) ran out."""
        if self.ahead is not _NOTHING:
            batch, self.ahead = self.ahead, _NOTHING
            return batch
        return _next_batch(self.iterator, self.what)

    def _step(self, step: int, raw_batch, last: bool):
        """One training step under the sentinels, read at once; returns (trip, state) or
        (None, None)."""
        if self.coord is not None and self.coord.terminated:
            raise KeyboardInterrupt      # torchrun is stopping the group: partial report
        started = time.perf_counter()
        rng = RngState.capture()
        leaves: list = []
        batch = move(raw_batch, self.session.device, leaves)
        self.watches.activations.begin(step)
        loss = forward_backward(self.session, batch, zero_grad=self.sentinels.zero_grad)
        scale = self.precision.scale if self.precision.scaler is not None else None
        # The batch, the weights as this step's forward saw them (a bad last update shows
        # here) and this step's gradients, in one fused reduction.
        readout = self.sentinels.step_readout(loss, leaves)
        read, table, extras = self._readout(readout, loss, last)
        batch_norm, norm, loss_value, gnorm = readout.read(read)
        ok_batch = _batch_ok(batch_norm, leaves)
        norm, gnorm = confirm_norms(self.sentinels, norm, gnorm)
        if scale is not None:
            gnorm = gnorm / scale
        self.outcome.steps_run = step + 1
        trip = self._classify(step, table, ok_batch, norm, loss_value, gnorm)
        trip, scaler_step = self._advance(step, trip, norm, readout, scale, loss_value, gnorm)
        fields = self.watches.observe(step, read[len(readout) + len(table):],
                                      self.outcome.timeline,
                                      loss_value, gnorm, extras)
        self.outcome.timeline.append(timeline_entry(step, loss_value, gnorm, norm,
                                                    self.optimizer, started, scale, scaler_step,
                                                    **fields))
        return (trip, StepState(step, batch, rng, scale)) if trip is not None else (None, None)

    def _readout(self, readout, loss, last: bool):
        """The one host sync of the step: the fixed values, the exchanged rank table (torchrun)
        and the watches' sampled values, in one tensor."""
        parts = [readout.values]
        if self.coord is not None:
            self.ahead = _END if last else _next_batch(self.iterator, self.what)
            row = _rank_row(self.coord, readout, loss, self.ahead is _END)
            parts.append(self.coord.exchange(row).reshape(-1))
        extra, extras = self.watches.extra_readout()
        values = torch.cat(parts + extra) if len(parts) + len(extra) > 1 else parts[0]
        read = self.coord.read(values) if self.coord is not None else values.tolist()
        self.outcome.host_syncs += 1
        width = self.coord.world_size * len(FLAGS) if self.coord is not None else 0
        return read, read[len(readout):len(readout) + width], extras

    def _deferred_step(self, step: int, raw_batch):
        """One training step whose readout is read at the next step (or at the end); the
        device skips the update if any of its values is non-finite. Returns the previous
        step's (trip, state), or (None, None)."""
        started = time.perf_counter()
        updated = self.updated
        rng = RngState.capture()
        leaves: list = []
        batch = move(raw_batch, self.session.device, leaves)
        saved = self.keeper.save()
        self.watches.activations.begin(step)
        loss = forward_backward(self.session, batch, zero_grad=self.sentinels.zero_grad)
        readout = self.sentinels.step_readout(loss, leaves)
        self.skip.note(readout.values)
        if self.session.config.grad_clip:
            self.sentinels.clip_(readout.grad_norm(), self.session.config.grad_clip)
        if _samples_update(self.watches.updates, step):
            self.watches.updates.before_update(step, readout.state_norm())
        self.skip.step(self.optimizer, lambda: call_user(self.optimizer_what,
                                                         self.optimizer.step))
        self.watches.updates.after_update()
        self.updated = True
        extra, extras = self.watches.extra_readout()
        values = readout.values
        handle = self.reader.send(torch.cat([values] + extra) if extra else values)
        previous, self.pending = self.pending, _Pending(
            step, batch, rng, saved, readout, handle, extras, started, time.perf_counter(),
            updated)
        if previous is None:
            return None, None
        return self._settle(previous, self.pending)

    def _settle(self, previous: _Pending, current: _Pending | None):
        """Read a deferred step. All finite: it goes into the timeline. Otherwise the device
        skipped its update and every one since: put the buffers and the RNG back, and run that
        step again with the synchronous read, which confirms, classifies and (for a false
        alarm) applies the update; then the step after it, and the rest of the run, read
        synchronously too."""
        read = self.reader.receive(previous.handle)
        self.outcome.host_syncs += 1
        batch_norm, norm, loss_value, gnorm = previous.readout.read(read)
        if math.isfinite(batch_norm + norm + loss_value + gnorm):
            self.outcome.steps_run = previous.step + 1
            fields = self.watches.observe(previous.step, read[len(previous.readout):],
                                          self.outcome.timeline,
                                          loss_value, gnorm, previous.extras)
            self.outcome.timeline.append(timeline_entry(
                previous.step, loss_value, gnorm, norm, self.optimizer, previous.started,
                ended=previous.ended, **fields))
            return None, None
        self.pending = None
        self.skip.clear()
        self.keeper.restore(previous.buffers)
        previous.rng.restore()
        self.updated = previous.updated
        self.read = replace(self.read, sync_from=previous.step)
        self.outcome.read_mode = self.read
        trip, state = self._step(previous.step, previous.batch, last=False)
        if trip is not None or current is None:
            return trip, state
        current.rng.restore()            # a false alarm: the next step again, in order
        return self._step(current.step, current.batch, last=False)

    def _classify(self, step, table, ok_batch, norm, loss_value, gnorm) -> Trip | None:
        if self.coord is None:
            return classify_step(step, ok_batch, norm, loss_value, gnorm, self.updated)
        exhausted = FLAGS.index("exhausted")
        if any(table[i + exhausted] for i in range(0, len(table), len(FLAGS))):
            self.ahead = _END            # a rank ran out of data: all stop after this step
        return _classify_ranks(step, table, norm, loss_value, gnorm, self.updated)

    def _advance(self, step, trip, norm, readout, scale, loss_value, gnorm):
        """The update, when the read said all is finite; under a GradScaler, non-finite
        gradients are a skipped step unless the scale collapsed. Returns (trip, scaler_step)."""
        precision, optimizer = self.precision, self.optimizer
        if trip is not None and trip.check == "gradient" and precision.scaler is not None:
            scaler_step = precision.after_readout(optimizer, grads_finite=False)
            precision.finish_update(optimizer)
            if scaler_step.collapsed:
                return Trip(step, "gradient", loss_value, gnorm, note=scaler_step.collapsed,
                            rank=trip.rank), scaler_step
            return None, scaler_step
        if trip is not None or optimizer is None:
            return trip, None
        scaler_step = precision.after_readout(optimizer, grads_finite=True)
        if self.session.config.grad_clip:
            total = readout.grad_norm()
            total = total / scale if scale is not None else total
            self.sentinels.clip_(total, self.session.config.grad_clip)
        self.watches.updates.before_update(step, norm)
        call_user(self.optimizer_what, optimizer.step)
        self.watches.updates.after_update()
        precision.finish_update(optimizer)
        self.updated = True
        return None, scaler_step

    def _final_check(self) -> None:
        """The weights after the last update (the only read outside a step)."""
        if self.updated:
            final, _ = confirm_norms(self.sentinels, float(self.sentinels.state_norm()), 0.0)
            self.outcome.host_syncs += 1
            if not math.isfinite(final):
                self.outcome.trip = Trip(self.outcome.steps_run - 1, "optimizer")
        self.watches.finish(self.outcome.timeline)


_NOTHING, _END = object(), object()


def _rank_row(coord, readout, loss, exhausted: bool) -> torch.Tensor:
    """This rank's flags for the exchange, in FLAGS order, all on the device (no sync)."""
    bad_loss = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(())
    grad_flag = coord.local_gradient_flag(readout.grad_norm)
    return torch.stack([readout.batch_bad(), bad_loss, grad_flag.reshape(()),
                        torch.tensor(float(exhausted), dtype=torch.float64,
                                     device=readout.values.device)])


def _samples_update(updates, step: int) -> bool:
    """Does the update-ratio watch sample this step? (its base norm is then worth computing)"""
    return bool(updates.every and step % updates.every == 0 and updates.params)


def _batch_ok(batch_norm: float, leaves) -> float:
    """1.0 when the batch is finite: its norm is, or (a float32 overflow) every element is."""
    if math.isfinite(batch_norm) or not confirm_nonfinite(leaves):
        return 1.0
    return 0.0


def _classify_ranks(step, table, norm, loss_value, gnorm, updated) -> Trip | None:
    """The same decision on every rank, from the exchanged table: the first rank whose own
    batch, loss or local gradients went bad is the one the finding names."""
    width = len(FLAGS)
    rows = [table[i:i + width] for i in range(0, len(table), width)]

    def first(flag: str):
        return next((r for r, row in enumerate(rows) if row[FLAGS.index(flag)] > 0), None)
    rank = first("input")
    if rank is not None:
        return Trip(step, "input", loss_value, gnorm, rank=rank)
    if not math.isfinite(norm):            # identical on every rank: DDP keeps weights in step
        return Trip(step - 1, "optimizer") if updated else Trip(step, "parameter")
    for check in ("loss", "gradient"):
        rank = first(check)
        if rank is not None:
            return Trip(step, check, loss_value, gnorm, rank=rank)
    if not math.isfinite(gnorm):
        return Trip(step, "gradient", loss_value, gnorm)
    return None
