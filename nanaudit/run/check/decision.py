"""What a step's check decides about the step's update, as a value every front end acts on
(the loop and the script auditor run or hold back `optimizer.step()`, `Sentinel` raises).

A later mode that skips a bad step and goes on (restoring the step's buffers from the step
record, run/step_record.py) adds its member here, and each front end's one `match` on the
decision is where it acts on it."""

from __future__ import annotations

from enum import Enum


class StepDecision(Enum):
    """What becomes of the update of a step whose read is in."""

    APPLY = "apply"     # every value finite (or a GradScaler skip in AMP's normal course)
    STOP = "stop"       # a check tripped: hold the update back, report, stop the run

    @classmethod
    def of(cls, tripped: object) -> StepDecision:
        """STOP when a check tripped (`tripped` is not None), else APPLY."""
        return cls.APPLY if tripped is None else cls.STOP
