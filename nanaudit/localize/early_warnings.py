"""Early warnings linked to the finding they came before: the finding names the most relevant
earliest one, and growth before an fp32 overflow makes its cause `divergence` (the weights grew
until a value overflowed, not a dtype too narrow for a healthy value)."""

from __future__ import annotations

from nanaudit.localize.causes import fix_for
from nanaudit.report.model import Finding
from nanaudit.report.vocabulary import Cause

GROWTH_WARNINGS = ("loss-spike", "grad-growth", "update-ratio")


def attach_warnings(finding: Finding | None, warnings: list, precision: str) -> None:
    """Link the early warnings that came before a finding to it: growth before an fp32
    overflow makes the cause `divergence`; the most relevant earliest warning is named."""
    if finding is None:
        return
    before = [w for w in warnings if w.step <= finding.step]
    if not before:
        return
    growth = [w for w in before if w.kind in GROWTH_WARNINGS]
    near = [w for w in before if w.kind == "near-overflow"]
    if (growth and precision == "fp32" and finding.cause in (Cause.DTYPE_OVERFLOW, Cause.UNKNOWN)
            and finding.where in ("forward", "backward")):
        finding.cause, finding.fix = Cause.DIVERGENCE, fix_for(Cause.DIVERGENCE)
    if finding.cause == Cause.DTYPE_OVERFLOW and near:
        # The module that overflowed, warned about earlier, says more than any growth metric.
        relevant = [w for w in near if w.module == finding.module] or near
    elif finding.cause == Cause.DIVERGENCE and growth:
        relevant = growth
    else:
        relevant = before
    first = min(relevant, key=lambda w: (w.step, w.began))
    finding.first_warning = first
    began = f" (growing since step {first.began})" if first.began < first.step else ""
    finding.explain(f"nanaudit warned at step {first.step}{began}: {first.kind}, "
                    f"{first.message}")
