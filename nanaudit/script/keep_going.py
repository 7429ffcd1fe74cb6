"""`nanaudit run --keep-going`: what the script auditor does with a bad step instead of stopping.

At a trip the check core decides (`keep_going`, run/check/decision.py: the stop rules are
written there once). SKIP: the step is localized right there, in the script's process, by the
in-process replay (its RNG streams forked and put back, so the script's draws are its own),
its finding is recorded (`action` skipped), the model's buffers go back to their values before
the step's first forward (the step record's copy), and the optimizer's update is held back
(held_update.py); then the script goes on. STOP: the run stops as without --keep-going, and the
runner records that last finding with why it stopped. Each bad step's finding goes into a
bounded BadStepLog (report/bad_steps.py), which the runner puts in the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.model import Finding
from nanaudit.report.vocabulary import BadStepAction, Check, StopReason
from nanaudit.run.check.decision import StepDecision, keep_going
from nanaudit.run.step_record import StepRecord
from nanaudit.script.batch_origin import StepBatches, name_samples
from nanaudit.script.held_update import HeldUpdates
from nanaudit.script.trip import ScriptTrip


class KeepGoing:
    """The bad steps of one script run that keeps going. `localize(trip)` names a bad step's
    op in-process and returns its finding (the runner's own, given in: this module does not
    import the tracer)."""

    def __init__(self, max_bad_steps: int, localize: Callable[[ScriptTrip], Finding],
                 step: Callable[[], int]):
        self.log = BadStepLog(max_bad_steps)
        self.held = HeldUpdates()
        self.stop_reason: StopReason | None = None
        self._localize = localize
        # the DataLoader batches of the current step, entered for the run (batch_origin.py)
        self.batches = StepBatches(step)

    def decide(self, trip: ScriptTrip, skippable: bool) -> StepDecision:
        """SKIP or STOP for a step that tripped (the reason of a STOP is kept)."""
        decision, self.stop_reason = keep_going(trip.check, self.log.skipped,
                                                self.log.max_bad_steps, skippable,
                                                in_forward=trip.in_buffers)
        return decision

    def skip(self, trip: ScriptTrip, record: StepRecord) -> bool:
        """A skipped step: localized and recorded, then its buffers as before its first
        forward (after the replay, which leaves them as the trip did). True: hold the update
        back. A loss the script's own guard skipped before backward (`if not
        torch.isfinite(loss): continue`), with finite gradients after it, was left out by the
        script already: the update that follows is the next batch's, and is applied."""
        finding = self._localize(trip)
        name_samples(finding, trip, record.calls, self.batches.recent)
        self.log.record(finding, BadStepAction.SKIPPED)
        if trip.unreached and trip.grad_norm is not None and math.isfinite(trip.grad_norm):
            return False
        record.restore_buffers()
        return True

    def ended(self, finding: Finding, trip: ScriptTrip, record: StepRecord) -> None:
        """The bad step the run ended at: stopped by the decision, or met when the script
        raised (no update to hold back: it stops) or ended (a loss no update followed: a
        skipped step, unless the stop rules say otherwise)."""
        name_samples(finding, trip, record.calls, self.batches.recent)
        reason = self.stop_reason
        if reason is None:
            decision, reason = keep_going(trip.check, self.log.skipped, self.log.max_bad_steps,
                                          skippable=trip.check != Check.ERROR,
                                          in_forward=trip.in_buffers)
            if decision is StepDecision.SKIP:
                self.log.record(finding, BadStepAction.SKIPPED)
                return
        self.log.record(finding, BadStepAction.STOPPED, reason)
