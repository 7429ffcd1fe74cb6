"""The step loop: seeded training steps under cheap sentinels, stopping before a bad update.

Each step reads the device once: the loss and the per-tensor norms of the batch, the weights
(as the previous update left them) and the gradients travel together in one small tensor, with
the early-warning values appended when there are any (watch_readout.py). How a step is read is
its strategy: the sync read (sync_step.py, the standard step and accumulation windows), the
deferred read (deferred_step.py: CUDA with a fused optimizer) and the checks inside the user's
own step (gated_step.py, `step:`). This module drives them: the data, the steps, and the last
read of the weights after the final update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanaudit.errors import USER_FAILURES, ConfigError, Problem, UserCodeError, call_user
from nanaudit.report.vocabulary import Check
from nanaudit.run.checks import StepChecks, confirm_norms
from nanaudit.run.deferred import BufferKeeper, ReadMode, choose_read
from nanaudit.run.deferred_step import DeferredStep
from nanaudit.run.gated_step import GatedStep
from nanaudit.run.session import Session
from nanaudit.run.step import RngState, ScanOutcome, Trip
from nanaudit.run.sync_step import SyncStep
from nanaudit.run.watch_readout import WatchReadout

# What `fetch` gives when the data (or, under torchrun, any rank's) ran out.
DATA_END = object()
_NOTHING = object()     # no batch fetched ahead


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
    loop = StepLoop(session, update, outcome if outcome is not None else ScanOutcome())
    try:
        loop.run(max_steps, start_step, on_step, stop_on_trip, on_trip)
    except KeyboardInterrupt:
        loop.outcome.interrupted = True
    finally:
        loop.watches.close()
    return loop.outcome


def next_batch(iterator: Iterator, what: str) -> Any:
    """The next batch, or DATA_END when the data is exhausted (under torchrun every rank must
    know before the step's exchange); the user's iterator raising is their error."""
    try:
        return next(iterator)
    except StopIteration:
        return DATA_END
    except (KeyboardInterrupt, UserCodeError, ConfigError):
        raise
    except USER_FAILURES as exc:
        raise UserCodeError(what, exc) from exc


class StepLoop:
    """One run of the step loop: the data, and what its step strategies share (the sentinels,
    the detectors, whether an update ran since the weights were last read, the read mode)."""

    def __init__(self, session: Session, update: bool, outcome: ScanOutcome):
        self.unit = session.unit
        if self.unit.owns_update and session.coordinator is not None:
            raise ConfigError([Problem("step", "the user's own step (`step:`) runs in one "
                                       "process: under torchrun its checks would have to agree "
                                       "across ranks inside your function; use `loss:`, or "
                                       "`Sentinel` in your DDP loop")])
        self.session, self.outcome = session, outcome
        self.sentinels = StepChecks(session.model, session.device)
        self.optimizer = session.optimizer if update else None
        self.optimizers = list(session.optimizers.values())
        self.precision = session.precision
        self.coord = session.coordinator
        self.watches = WatchReadout(session, self.sentinels.param_values,
                                    self.optimizer is not None)
        outcome.warnings = self.watches.warnings
        self.updated = False            # has an optimizer step run since the last read?
        self.what = f"the data from `{session.options.data_label}`"
        self.optimizer_what = (f"optimizer step of `{type(self.optimizer).__name__}`"
                               if self.optimizer is not None else "")
        self.iterator: Iterator = iter(())   # the data's, from `run`
        self.ahead: Any = _NOTHING      # under torchrun: the next batch, fetched early
        self.read = choose_read(session.options.sentinel_read,
                                torch.device(session.device), self.optimizer,
                                self.precision.scaler, self.coord is not None,
                                single_step=(self.unit.window == 1
                                             and not self.unit.owns_update
                                             and len(session.optimizers) <= 1
                                             and not session.schedulers))
        self.window = self.unit.window
        self.fetched = 0                # batches taken from the data so far (batch_index)
        # The sync read keeps the buffers from before each micro-batch's forward: the replay
        # starts from them, and the state check reads them (BatchNorm's statistics change
        # inside the forward).
        self.buffers = BufferKeeper(session.local_model, slots=self.window)
        self.has_buffers = bool(self.buffers.buffers)

    def run(self, max_steps, start_step, on_step, stop_on_trip, on_trip) -> None:
        if not stop_on_trip and self.read.mode == "deferred":
            self.read = ReadMode("sync", "every tripping batch is reported (bisect)")
        sync = SyncStep(self)
        deferred = DeferredStep(self, sync) if self.read.mode == "deferred" else None
        gated = GatedStep(self) if self.unit.owns_update else None
        self.outcome.read_mode = self.read
        # A second read of the data (naming the op that made a bad batch) starts from here.
        self.outcome.data_rng = RngState.capture()
        data = self.session.make_data()
        self.iterator = call_user(f"iterating {self.what}", iter, data)
        for _ in range(start_step * self.window):
            if self.fetch() is DATA_END:
                break
        step = start_step
        while max_steps is None or step < start_step + max_steps:
            raws = self._fetch_window()
            if raws is None:
                break
            last = max_steps is not None and step + 1 >= start_step + max_steps
            if gated is not None:
                trip, state = gated.run(step, raws[0])
            elif deferred is not None and self.read.defers:
                trip, state = deferred.run(step, raws[0])
            else:
                trip, state = sync.run(step, raws, last)
            if trip is not None:
                if stop_on_trip:
                    self.outcome.trip, self.outcome.state = trip, state
                    return
                on_trip(trip, state)
            if on_step:
                on_step(step)
            step += 1
        if deferred is not None:
            trip, state = deferred.finish()
            if trip is not None:
                self.outcome.trip, self.outcome.state = trip, state
                return
        self._final_check()

    def fetch(self) -> Any:
        """The next raw batch, or DATA_END when the data (or, under torchrun, any rank's) ran
        out."""
        if self.ahead is not _NOTHING:
            batch, self.ahead = self.ahead, _NOTHING
        else:
            batch = next_batch(self.iterator, self.what)
        if batch is not DATA_END:
            self.fetched += 1
        return batch

    def fetch_ahead(self, last: bool) -> bool:
        """Under torchrun, take the next batch now, before the step's exchange, so that every
        rank learns together that one ran out. Returns whether this rank's data is exhausted."""
        self.ahead = DATA_END if last else next_batch(self.iterator, self.what)
        return self.ahead is DATA_END

    def stop_after_this_step(self) -> None:
        """A rank ran out of data: every rank stops after this step."""
        self.ahead = DATA_END

    def _fetch_window(self) -> list | None:
        """The raw batches of one optimizer step, or None at the end of the data. A last window
        the data cannot fill is not run: a loop that steps every N micro-batches never applies
        it either."""
        if self.window == 1:            # the common case, without the loop
            raw = self.fetch()
            return None if raw is DATA_END else [raw]
        raws = []
        for _ in range(self.window):
            raw = self.fetch()
            if raw is DATA_END:
                return None
            raws.append(raw)
        return raws

    def _final_check(self) -> None:
        """The weights after the last update (the only read outside a step)."""
        if self.updated:
            final, _ = confirm_norms(self.sentinels, float(self.sentinels.state_norm()), 0.0)
            self.outcome.host_syncs += 1
            if not math.isfinite(final):
                self.outcome.trip = Trip(self.outcome.steps_run - 1, Check.OPTIMIZER)
        self.watches.finish(self.outcome.timeline)
