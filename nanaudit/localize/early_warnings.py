"""Early warnings linked to the finding they came before, only where they bear on it.

A warning joins a finding's explanation (and becomes its `first_warning`) only when all hold:
  - the finding's cause is one where growth or overflow is the mechanism: `divergence`,
    `dtype-overflow`, `exp-overflow` (a bad row, a log of zero or a masked gradient is not
    explained by a growing series, however loud);
  - it was seen at most WINDOW steps before the finding's step (growth that makes a value
    overflow compounds over tens of steps; a warning thousands of steps earlier, long quiet
    since, says nothing of this step);
  - it is about the same thing: a near-overflow warning names the module whose output neared
    its dtype's largest value, and bears only on a finding made in that module; the growth
    warnings (loss spike, gradient growth, update ratio) are of the model's own series (its
    loss, its gradient norm, its weights' updates), and bear on a finding made in forward,
    backward or the optimizer, where those series are computed.
Otherwise the warning stays in the report's `warnings` list and the finding says nothing of it.
Growth before an fp32 overflow (or an unexplained value) makes the cause `divergence`: the
weights grew until a value overflowed, not a dtype too narrow for a healthy value.
"""

from __future__ import annotations

from nanaudit.localize.causes import fix_for
from nanaudit.report.model import EarlyWarning, Finding
from nanaudit.report.vocabulary import Cause, WarningKind, Where

WINDOW = 100         # steps from a warning to the finding it may explain
GROWTH_WARNINGS = (WarningKind.LOSS_SPIKE, WarningKind.GRAD_GROWTH, WarningKind.UPDATE_RATIO)
OVERFLOW_CAUSES = (Cause.DIVERGENCE, Cause.DTYPE_OVERFLOW, Cause.EXP_OVERFLOW)
SERIES_PHASES = (Where.FORWARD, Where.BACKWARD, Where.OPTIMIZER)


def bears_on(warning: EarlyWarning, finding: Finding) -> bool:
    """Whether `warning` is about what `finding` names, inside the window (the cause aside)."""
    if not 0 <= finding.step - warning.step <= WINDOW:
        return False
    if warning.kind == WarningKind.NEAR_OVERFLOW:
        return warning.module is not None and warning.module == finding.module
    return warning.kind in GROWTH_WARNINGS and finding.where in SERIES_PHASES


def attach_warnings(finding: Finding | None, warnings: list, precision: str) -> None:
    """Link the early warnings that bear on a finding to it (see the module docstring)."""
    if finding is None:
        return
    bearing = [w for w in warnings if bears_on(w, finding)]
    growth = [w for w in bearing if w.kind in GROWTH_WARNINGS]
    near = [w for w in bearing if w.kind == WarningKind.NEAR_OVERFLOW]
    if (growth and precision == "fp32" and finding.cause in (Cause.DTYPE_OVERFLOW, Cause.UNKNOWN)
            and finding.where in (Where.FORWARD, Where.BACKWARD)):
        finding.cause, finding.fix = Cause.DIVERGENCE, fix_for(Cause.DIVERGENCE)
    if finding.cause not in OVERFLOW_CAUSES or not bearing:
        return
    # The module that overflowed, warned about earlier, says more than any growth metric; a
    # divergence is told by its growth first.
    if finding.cause == Cause.DIVERGENCE:
        relevant = growth or near
    else:
        relevant = near or growth
    first = min(relevant, key=lambda w: (w.step, w.began))
    finding.first_warning = first
    began = f" (growing since step {first.began})" if first.began < first.step else ""
    finding.explain(f"nanaudit warned at step {first.step}{began}: {first.kind}, "
                    f"{first.message}")
