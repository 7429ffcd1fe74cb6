"""What a step's check decides about the step's update, as a value every front end acts on
(the loop and the script auditor run or hold back `optimizer.step()`, `Sentinel` raises).

Keep-going (`--keep-going`, `on_finding="skip"`) turns a trip into SKIP: the front end holds
the update back and puts the step's buffers back as they were before its first forward, so the
step leaves no trace. `keep_going` below is the one place that says when skipping cannot help
and the run stops instead."""

from __future__ import annotations

from enum import Enum

from nanaudit.report.vocabulary import Check, StopReason


class StepDecision(Enum):
    """What becomes of the update of a step whose read is in."""

    APPLY = "apply"     # every value finite (or a GradScaler skip in AMP's normal course)
    STOP = "stop"       # a check tripped: hold the update back, report, stop the run
    SKIP = "skip"       # a check tripped under keep-going: hold the update back, report, go on

    @classmethod
    def of(cls, tripped: object) -> StepDecision:
        """STOP when a check tripped (`tripped` is not None), else APPLY."""
        return cls.APPLY if tripped is None else cls.STOP


# A non-finite weight, buffer or optimizer state is there before the step: skipping the
# update leaves it in place, so every later step would trip on it too. So is a learning rate
# no update may run with: a skipped step does not step the scheduler that set it.
_STATE_CHECKS = (Check.PARAMETER, Check.SCHEDULE)


def keep_going(check: Check | None, skipped: int, max_bad_steps: int,
               skippable: bool = True,
               in_forward: bool = False) -> tuple[StepDecision, StopReason | None]:
    """The decision under keep-going for a step whose trip (if any) names `check`, after
    `skipped` bad steps were skipped: (decision, why the run stops, or None). `skippable`
    False: the front end cannot hold this step's update back (a hand-written update has no
    optimizer call to leave out; a closure's later evaluation comes after its optimizer moved
    the weights; the script raised), so the step stops the run. `in_forward`: a PARAMETER
    trip of buffers this step's own forward made non-finite, which go back with the step's
    buffers: not state from before the step."""
    if check is None:
        return StepDecision.APPLY, None
    if check == Check.OPTIMIZER:
        # The weights are read before the next update, so the update that made them
        # non-finite was applied already: there is no update left to hold back (the weights
        # were finite before the bad step, so they were not its state either).
        return StepDecision.STOP, StopReason.CANNOT_SKIP
    if check in _STATE_CHECKS and not (in_forward and check == Check.PARAMETER):
        return StepDecision.STOP, StopReason.NONFINITE_STATE
    if not skippable:
        return StepDecision.STOP, StopReason.CANNOT_SKIP
    if skipped >= max_bad_steps:
        return StepDecision.STOP, StopReason.MAX_BAD_STEPS
    return StepDecision.SKIP, None
