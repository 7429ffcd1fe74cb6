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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanaudit.errors import ConfigError, Problem, UserCodeError, call_user
from nanaudit.run.batch import float_leaves, move
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
    current_lr,
    timeline_entry,
)
from nanaudit.run.units import lr_problem, step_schedulers
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
    except Exception as exc:
        raise UserCodeError(what, exc) from exc


@dataclass
class _Extras:
    """Which early-warning values a readout carries after its fixed part, in order."""

    update_step: int | None = None
    update_base: float | None = None    # None: the base norm rides in the readout too
    labels: list | None = None          # the activation watch's labels (None: not sampled)


_NO_EXTRAS = _Extras()                  # shared, never written: a step with nothing sampled


class _Watches:
    """The early-warning detectors of one run, and where their readout values go."""

    def __init__(self, session: Session, sentinels: StepChecks, updating: bool):
        options = session.options.watch
        every = options.activation_every(session.precision.name)
        self.activations = ActivationWatch(session.local_model, every, options.near_overflow)
        update_every = options.update_every if (updating and options.update_ratio) else 0
        self.updates = UpdateWatch(sentinels.params, update_every, session.device)
        self.growth = GrowthWatch(options)
        self.warnings: list = []

    def extra_readout(self) -> tuple[list[torch.Tensor], _Extras]:
        """The values this step adds to the readout ([update norm (, its base)], [activation
        maxima]) and what they are, for `observe` (which may run a step later)."""
        if self.updates.pending_norm is None and not self.activations.maxima:
            self.activations.active = False
            return [], _NO_EXTRAS           # most steps: nothing sampled
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
        if not found:
            return
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
        self.optimizers = list(session.optimizers.values())
        self.precision = session.precision
        self.coord = session.coordinator
        self.watches = _Watches(session, self.sentinels, self.optimizer is not None)
        outcome.warnings = self.watches.warnings
        self.updated = False            # has an optimizer step run since the last read?
        self.what = f"the data from `{session.options.data_label}`"
        self.optimizer_what = (f"optimizer step of `{type(self.optimizer).__name__}`"
                               if self.optimizer is not None else "")
        self.iterator = None
        self.ahead = _NOTHING           # under torchrun: the next batch, fetched early
        self.read = choose_read(session.options.sentinel_read,
                                torch.device(session.device), self.optimizer,
                                self.precision.scaler, self.coord is not None,
                                single_step=(session.unit.window == 1
                                             and not session.unit.owns_update
                                             and len(session.optimizers) <= 1
                                             and not session.schedulers))
        self.pending: _Pending | None = None
        self.skip = self.keeper = self.reader = None
        self.unit = session.unit
        if self.unit.owns_update and self.coord is not None:
            raise ConfigError([Problem("step", "the user's own step (`step:`) runs in one "
                                       "process: under torchrun its checks would have to agree "
                                       "across ranks inside your function; use `loss:`, or "
                                       "`Sentinel` in your DDP loop")])
        self.window = self.unit.window
        self.fetched = 0                # batches taken from the data so far (batch_index)
        # The sync read keeps the buffers from before each micro-batch's forward: the replay
        # starts from them, and the state check reads them (BatchNorm's statistics change
        # inside the forward).
        self.buffers = BufferKeeper(session.local_model, slots=self.window)
        self.has_buffers = bool(self.buffers.buffers)
        self.user_checks: dict = {}     # `step:`: id(optimizer) -> StepChecks over its params
        self.stepped: set = set()       # `step:`: optimizers updated since their last check

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
        for _ in range(start_step * self.window):
            if self._fetch() is _END:
                break
        step = start_step
        while max_steps is None or step < start_step + max_steps:
            raws = self._fetch_window()
            if raws is _END:
                break
            last = max_steps is not None and step + 1 >= start_step + max_steps
            if self.unit.owns_update:
                trip, state = self._user_step(step, raws[0])
            elif self.read.defers:
                trip, state = self._deferred_step(step, raws[0])
            else:
                trip, state = self._step(step, raws, last)
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
        else:
            batch = _next_batch(self.iterator, self.what)
        if batch is not _END:
            self.fetched += 1
        return batch

    def _fetch_window(self):
        """The raw batches of one optimizer step, or _END. A last window the data cannot fill
        is not run: a loop that steps every N micro-batches never applies it either."""
        if self.window == 1:
            raw = self._fetch()
            return _END if raw is _END else [raw]
        raws = []
        for _ in range(self.window):
            raw = self._fetch()
            if raw is _END:
                return _END
            raws.append(raw)
        return raws

    def _step(self, step: int, raws: list, last: bool, first_index: int | None = None):
        """One optimizer step (one batch, or an accumulation window of them) under the
        sentinels, read at once; returns (trip, state) or (None, None)."""
        if self.coord is not None and self.coord.terminated:
            raise KeyboardInterrupt      # torchrun is stopping the group: partial report
        started = time.perf_counter()
        first_index = self.fetched - len(raws) if first_index is None else first_index
        micros, leaves, loss = self._forward_backward(raws, first_index, step)
        scale = self.precision.scale if self.precision.scaler is not None else None
        # The batch, the weights as this step's forward found them (a bad last update shows
        # here) and this step's gradients, in one fused reduction.
        state = self.sentinels.state_before(micros[0].buffers)
        readout = self.sentinels.step_readout(loss, leaves, state)
        read, table, extras = self._readout(readout, loss, last)
        batch_norm, norm, loss_value, gnorm = readout.read(read)
        # The common case, all finite, needs nothing confirmed or classified.
        all_finite, ok_batch = math.isfinite(batch_norm + norm + loss_value + gnorm), 1.0
        if not all_finite:
            ok_batch = _batch_ok(batch_norm, leaves)
            norm, gnorm = confirm_norms(self.sentinels, norm, gnorm, state)
        if scale is not None:
            gnorm = gnorm / scale
        self.outcome.steps_run = step + 1
        trip = (None if all_finite and self.coord is None else
                self._classify(step, table, ok_batch, norm, loss_value, gnorm))
        lr = current_lr(self.optimizer)
        trip, scaler_step = self._advance(step, trip, norm, readout, scale, loss_value, gnorm)
        fields = self.watches.observe(step, read[len(readout) + len(table):],
                                      self.outcome.timeline,
                                      loss_value, gnorm, extras)
        self.outcome.timeline.append(timeline_entry(step, loss_value, gnorm, norm,
                                                    self.optimizer, started, scale, scaler_step,
                                                    lr=lr, **fields))
        if trip is None:
            return None, None
        return trip, self._trip_state(trip, micros, scale)

    def _forward_backward(self, raws: list, first_index: int, step: int):
        """Every micro-batch's forward and backward, keeping what a replay of each needs;
        returns (micro-batch states, all batch leaves, the window's mean loss)."""
        micros, leaves, total = [], [], None
        self.watches.activations.begin(step)
        for i, raw in enumerate(raws):
            rng = RngState.capture()
            saved = self.buffers.save() if self.has_buffers else None
            batch = move(raw, self.session.device, leaves)
            loss = self.unit.forward_backward(
                batch, zero_grad=self.sentinels.zero_grad if i == 0 else None)
            micros.append(_Micro(batch, rng, saved, first_index + i))
            total = loss if total is None else total.detach() + loss.detach()
        # One batch: the loss itself (the readout detaches it); a window: the mean.
        return micros, leaves, total / len(raws) if len(raws) > 1 else total

    def _trip_state(self, trip: Trip, micros: list, scale) -> StepState:
        """The state a replay starts from: the whole step's, or in a window, the micro-batch
        that made the bad value (found by checking each one's inputs and loss, and for a
        gradient by re-running the window one micro-batch at a time)."""
        index = _first_bad_micro(trip, micros, self) if len(micros) > 1 else 0
        micro = micros[index]
        if len(micros) > 1:
            trip.micro_batch = index
        return StepState(trip.step, micro.batch, micro.rng, scale,
                         buffers=self.buffers.pairs(micro.buffers) if micro.buffers else None,
                         batch_index=micro.index,
                         micro_batch=index if len(micros) > 1 else None, window=len(micros))

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
        if self.coord is None:
            return read, (), extras
        start = len(readout)
        return read, read[start:start + self.coord.world_size * len(FLAGS)], extras

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
        loss = self.unit.forward_backward(batch, zero_grad=self.sentinels.zero_grad)
        readout = self.sentinels.step_readout(loss, leaves, self.sentinels.state_before(saved))
        self.skip.note(readout.values)
        if self.session.options.grad_clip:
            self.sentinels.clip_(readout.grad_norm(), self.session.options.grad_clip)
        self.watches.updates.measure(step, lambda: self.skip.step(
            self.optimizer, lambda: call_user(self.optimizer_what, self.optimizer.step)),
            readout.state_norm)
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
        trip, state = self._step(previous.step, [previous.batch], last=False,
                                 first_index=self.fetched - 1 - (current is not None))
        if trip is not None or current is None:
            return trip, state
        current.rng.restore()            # a false alarm: the next step again, in order
        return self._step(current.step, [current.batch], last=False)

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
            scaler_step = precision.after_readout(self.optimizers, grads_finite=False)
            precision.finish_update(self.optimizers)
            if scaler_step.collapsed:
                return Trip(step, "gradient", loss_value, gnorm, note=scaler_step.collapsed,
                            rank=trip.rank), scaler_step
            return None, scaler_step
        if trip is not None or optimizer is None:
            return trip, None
        # Without a scheduler nothing of nanaudit's moves the lr: one check, at the first update.
        problem = lr_problem(self.session) if (self.session.schedulers
                                               or not self.updated) else None
        if problem:
            return Trip(step, "schedule", loss_value, gnorm, note=problem), None
        scaler_step = None
        if precision.scaler is not None:
            scaler_step = precision.after_readout(self.optimizers, grads_finite=True)
        if self.session.options.grad_clip:
            total = readout.grad_norm()
            total = total / scale if scale is not None else total
            self.sentinels.clip_(total, self.session.options.grad_clip)
        self.watches.updates.measure(step, lambda: self.unit.update(loss_value), lambda: norm)
        if precision.scaler is not None:
            precision.finish_update(self.optimizers)
        self.updated = True
        return None, scaler_step

    def _user_step(self, step: int, raw_batch):
        """One call of the user's `step:` function, checked before each optimizer step it
        makes (one read each); a trip stops it there, before that update."""
        if self.coord is not None and self.coord.terminated:
            raise KeyboardInterrupt
        started = time.perf_counter()
        rng = RngState.capture()
        saved = self.buffers.save() if self.has_buffers else None
        leaves: list = []
        batch = move(raw_batch, self.session.device, leaves)
        self.watches.activations.begin(step)
        seen = _UserReads(leaves, saved)
        lr = current_lr(self.optimizer)
        run = self.unit.run(batch, lambda point: self._gate(step, point, seen))
        self.outcome.steps_run = step + 1
        if run.halted is None:
            seen.trip = self._returned_losses(step, run, seen)
        if seen.trip is None and run.updates and self.session.schedulers:
            step_schedulers(self.session.schedulers, seen.loss)
        self.outcome.timeline.append(timeline_entry(step, seen.loss, seen.gnorm, seen.norm,
                                                    self.optimizer, started, lr=lr))
        self.updated = self.updated or run.updates > 0
        if seen.trip is None:
            return None, None
        for put_back in reversed(run.undo):
            put_back()                   # the updates this call made before the bad one
        return seen.trip, StepState(
            step, batch, rng, buffers=self.buffers.pairs(saved) if saved else None,
            batch_index=self.fetched - 1,
            halt_at=run.halted.index if run.halted else None, undo=run.undo)

    def _gate(self, step: int, point, seen: _UserReads) -> bool:
        """The check before one optimizer step inside the user's step: its parameters as
        their last update left them, its gradients, the losses backpropagated since the last
        check and (at the first) the batch, in one read."""
        checks = self.user_checks.get(id(point.optimizer))
        if checks is None:
            params = [p for g in point.optimizer.param_groups for p in g["params"]]
            checks = self.user_checks[id(point.optimizer)] = StepChecks(
                self.session.local_model, self.session.device, params=params)
        first = not seen.checked
        loss = (torch.stack([t.detach().float().reshape(()) for t in point.losses]).sum()
                if point.losses else torch.zeros((), device=self.session.device))
        state = checks.state_before(seen.buffers) if first else checks._params
        readout = checks.step_readout(loss, seen.leaves if first else [], state)
        read = readout.values.tolist()
        self.outcome.host_syncs += 1
        batch_norm, norm, loss_value, gnorm = readout.read(read)
        ok_batch = _batch_ok(batch_norm, seen.leaves) if first else 1.0
        norm, gnorm = confirm_norms(checks, norm, gnorm, state)
        seen.checked = True
        seen.norm, seen.gnorm = norm, gnorm
        if point.losses and math.isfinite(loss_value):
            seen.loss = loss_value if seen.loss is None else seen.loss + loss_value
        updated = id(point.optimizer) in self.stepped
        trip = classify_step(step, ok_batch, norm, loss_value, gnorm, updated)
        if trip is None:
            problem = lr_problem(self.session, only=point.optimizer)
            trip = Trip(step, "schedule", loss_value, gnorm, note=problem) if problem else None
        if trip is None:
            self.stepped.add(id(point.optimizer))
            return True
        if trip.check == "optimizer":
            trip.step = step - 1
        trip.optimizer = point.name
        if trip.check == "loss":
            bad = [i for i, t in enumerate(point.losses) if not bool(torch.isfinite(t).all())]
            if bad and bad[0] < len(point.loss_names):
                trip.loss_name = point.loss_names[bad[0]]
        seen.trip = trip
        return False

    def _returned_losses(self, step: int, run, seen: _UserReads) -> Trip | None:
        """A returned loss the checks before the updates did not see (the step made no
        update, or never backpropagated it): one more read, only then."""
        unseen = {n: t for n, t in run.losses.items()
                  if not (seen.checked and t.requires_grad)}
        if not unseen:
            return None
        values = torch.stack([t.detach().float().reshape(()) for t in unseen.values()]).tolist()
        self.outcome.host_syncs += 1
        if seen.loss is None:
            seen.loss = sum(values)          # NaN carries, as the standard step shows it
        for (name, _), value in zip(unseen.items(), values):
            if not math.isfinite(value):
                note = ("found after the call's updates (no check before an update saw it): "
                        "the replay starts from the weights they left" if run.updates else None)
                return Trip(step, "loss", value, seen.gnorm, loss_name=name, note=note)
        return None

    def _final_check(self) -> None:
        """The weights after the last update (the only read outside a step)."""
        if self.updated:
            final, _ = confirm_norms(self.sentinels, float(self.sentinels.state_norm()), 0.0)
            self.outcome.host_syncs += 1
            if not math.isfinite(final):
                self.outcome.trip = Trip(self.outcome.steps_run - 1, "optimizer")
        self.watches.finish(self.outcome.timeline)


_NOTHING, _END = object(), object()


@dataclass
class _Micro:
    """One micro-batch of a window (the whole batch of a standard step) and its start state."""

    batch: Any
    rng: RngState
    buffers: list | None                # the BufferKeeper slot saved before its forward
    index: int                          # its data index


@dataclass
class _UserReads:
    """What the checks inside one call of the user's step have seen."""

    leaves: list
    buffers: list | None
    checked: bool = False
    loss: float | None = None
    norm: float = 0.0
    gnorm: float = 0.0
    trip: Trip | None = None


def _first_bad_micro(trip: Trip, micros: list, loop: _StepLoop) -> int:
    """The micro-batch of a window that made the bad value (syncs: only after a trip)."""
    if trip.check == "input":
        for i, micro in enumerate(micros):
            if any(not bool(torch.isfinite(t).all()) for _, t in float_leaves(micro.batch)):
                return i
    if trip.check in ("loss", "gradient"):
        # Run the window again one micro-batch at a time from its start state: the first whose
        # loss or accumulated gradients are non-finite made the value.
        unit, checks = loop.unit, loop.sentinels
        for i, micro in enumerate(micros):
            if micro.buffers:
                loop.buffers.restore(micro.buffers)
            micro.rng.restore()
            loss = unit.forward_backward(micro.batch, zero_grad=checks.zero_grad if i == 0
                                         else None)
            if not bool(torch.isfinite(loss.detach())) or \
                    not math.isfinite(float(checks.grad_norm())):
                return i
    return 0


def _rank_row(coord, readout, loss, exhausted: bool) -> torch.Tensor:
    """This rank's flags for the exchange, in FLAGS order, all on the device (no sync)."""
    bad_loss = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(())
    grad_flag = coord.local_gradient_flag(readout.grad_norm)
    return torch.stack([readout.batch_bad(), bad_loss, grad_flag.reshape(()),
                        torch.tensor(float(exhausted), dtype=torch.float64,
                                     device=readout.values.device)])


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
