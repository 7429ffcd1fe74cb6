"""`scan --keep-going`: each bad step the loop skips is localized as it happens, shared by the
ranks and recorded in the run's BadStepLog; at the end the stopping step joins it, the bad
inputs are traced in one read of the data, and the log fills the report.

Why localize at once: the replay needs the step's batch, RNG state and buffers, and the
weights as they were before that step; later steps move the weights on. The loop puts the
step's RNG streams and buffers back after the replay (run/loop.py), so the run goes on as if
the step had not been taken. Under torchrun the finding is built by the rank the trip names
(as a stopping one is) and handed to every rank, so every rank's log, and so its count of
skipped steps (which the check core's keep-going rule reads), is the same.

Naming what made a non-finite input reads the data again from its start; for every bad input
that is done once, after the loop, for all of them together, so a skip costs the same at
step 10 and at step 100,000. Under torchrun the rank whose batch it was traces it, and every
rank's log then takes the traced finding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nanaudit.report.model import Finding, Report
from nanaudit.report.vocabulary import BadStepAction, ProducerKind, Status, Where
from nanaudit.run.batch import batch_fingerprint
from nanaudit.run.step import ScanOutcome, StepState, Trip

# The finding of a tripped outcome on the rank that localizes it; None on the others.
Localize = Callable[[ScanOutcome], Finding | None]


class BadStepRecorder:
    """The bad steps of one `scan --keep-going` run (see the module docstring)."""

    def __init__(self, outcome: ScanOutcome, localize: Localize, coordinator: Any = None):
        assert outcome.bad_steps is not None, "a run that keeps going has a bad-step log"
        self.outcome, self.log = outcome, outcome.bad_steps
        self.localize, self.coordinator = localize, coordinator
        self.inputs: dict[int, tuple[list, Finding]] = {}   # batch index -> fingerprint, finding

    def on_skip(self, trip: Trip, state: StepState) -> None:
        """A skipped step: its finding, localized from the step's own state, recorded."""
        step = replace(self.outcome, trip=trip, state=state, steps_run=trip.step + 1)
        finding = self.shared(self.localize(step))
        self.log.record(finding, BadStepAction.SKIPPED)
        if self.log.whole[-1] is finding:
            self._note_input(finding, state)

    def shared(self, finding: Finding | None) -> Finding:
        """The finding every rank records: the localizing rank's (FSDP2's is already the same
        on every rank)."""
        coord = self.coordinator
        if coord is None or coord.sharded:
            assert finding is not None, "the one process localizes every trip"
            return finding
        from nanaudit.run.rank_checks import gather_by_store
        gathered = gather_by_store(coord, "bad-step-finding", finding,
                                   timeout_s=coord.options.timeout_s)
        return next(f for f in gathered if f is not None)

    def finish(self, report: Report, stopped: Finding | None,
               trace: Callable[[dict[int, tuple[list, Finding]]], None]) -> None:
        """The stopping step's finding (when the run stopped at one), the bad inputs traced
        (`trace`: one read of the data for them all), and the log in the report."""
        outcome = self.outcome
        if outcome.trip is not None:
            finding = self.shared(stopped)
            assert outcome.stop_reason is not None, "a stop under keep-going says why"
            self.log.record(finding, BadStepAction.STOPPED, outcome.stop_reason)
            if self.log.whole[-1] is finding and outcome.state is not None:
                self._note_input(finding, outcome.state)
        if self.inputs and not outcome.interrupted:     # a stopped run reads no more data
            trace(self.inputs)
        self._share_traced()
        self.log.apply(report)
        if self.log.count and report.status == Status.CLEAN:
            report.status = Status.NONFINITE

    def _share_traced(self) -> None:
        """Under torchrun each input finding is traced by the rank whose batch it was: every
        rank's log takes the traced findings, so each rank's report names what made them. The
        logs are the same on every rank, so every rank gathers here, or none."""
        coord = self.coordinator
        if coord is None or not any(f.where == Where.INPUT for f in self.log.whole):
            return
        from nanaudit.run.rank_checks import gather_by_store
        # Only what this rank traced: its copies of the other findings would name nothing new.
        traced = {finding.step: finding for _, finding in self.inputs.values()
                  if finding.producer is not None}
        self.log.adopt(merged_traced(gather_by_store(coord, "traced-inputs", traced,
                                                     timeout_s=coord.options.timeout_s)))

    def _note_input(self, finding: Finding, state: StepState) -> None:
        """A whole finding of a non-finite input, to be traced in the data read again."""
        if finding.where == Where.INPUT and state.batch_index is not None and \
                (self.coordinator is None or finding.rank in (None, self.coordinator.rank)):
            self.inputs[state.batch_index] = (batch_fingerprint(state.batch), finding)


def merged_traced(gathered: list[dict[int, Finding]]) -> dict[int, Finding]:
    """Every rank's traced findings (by rank), one per step: a trace that named what made the
    value over one that says why it could not (when several ranks traced the same step, every
    rank under FSDP2, a peer's batch names nothing), the lowest rank's among equals."""
    merged: dict[int, Finding] = {}
    for theirs in gathered:
        for step, finding in theirs.items():
            held = merged.get(step)
            if held is None or (_named(finding) and not _named(held)):
                merged[step] = finding
    return merged


def _named(finding: Finding) -> bool:
    producer = finding.producer
    return producer is not None and producer.made_by != ProducerKind.NOT_LOCALIZED
