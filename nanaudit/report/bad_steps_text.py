"""The words every renderer uses for a run that kept going: one line for the bad steps, the
persistent-cause sentence, the steps of a summary, and one row per bad step (whole findings
first, then the summarized groups)."""

from __future__ import annotations

import os
from typing import NamedTuple

from nanaudit.report.model import Finding, Report
from nanaudit.report.sections import BadStepGroup, BadSteps, StepSpans
from nanaudit.report.text import rows_label
from nanaudit.report.vocabulary import StopReason

WHY_STOPPED = {
    StopReason.MAX_BAD_STEPS: "--max-bad-steps ({limit}) bad steps were skipped already",
    StopReason.NONFINITE_STATE: "the weights, buffers or optimizer state were non-finite "
                                "before the step, so skipping it changes nothing",
    StopReason.CANNOT_SKIP: "its update could not be held back, or holding it back could not "
                            "help (the finding says why)",
}


class BadStepRow(NamedTuple):
    """One row of the bad-steps table: a whole finding, or a summarized group."""

    steps: str
    action: str
    cause: str
    op: str
    at: str                       # file:line, or "" when no line is named
    finding: Finding | None       # None for a summarized group
    rows: str = ""                # the batch (or micro-batch) and rows, when named


def bad_steps_line(section: BadSteps) -> str:
    """"3 bad steps (2 skipped); the run stopped at step 8: ..." """
    line = f"{section.count} bad step(s) ({section.skipped} skipped)"
    if section.stopped is not None:
        why = WHY_STOPPED[section.stopped].format(limit=section.max_bad_steps)
        line += f"; the run stopped at step {section.steps.last}: {why}"
    if section.count > section.whole:
        line += (f"; the first {section.whole} in full, the other "
                 f"{section.count - section.whole} summarized by cause, op and line")
    return line


def persistent_line(section: BadSteps, first: Finding | None) -> str | None:
    """The sentence of a persistent cause (report/bad_steps.py states the rule), or None."""
    if not section.persistent or first is None:
        return None
    return (f"persistent cause: every bad step ({section.count}) made the value at the same op "
            f"and line ({first.op} at {_at(first)}): skipping will not outrun it; fix the cause "
            f"(or filter the data the skip list names)")


def spans_text(steps: StepSpans) -> str:
    """"3, 5, 8-12" and, when runs were left out, "... (+N more runs) ... last"."""
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in steps.spans)
    if steps.spans_left_out:
        shown += f", ... (+{steps.spans_left_out} more run(s)) ..., {steps.last}"
    return shown


def bad_step_rows(report: Report) -> list[BadStepRow]:
    """One row per whole finding, then one per summarized group."""
    section = report.bad_steps
    if section is None:
        return []
    rows = [BadStepRow(str(f.step), str(f.action or ""), str(f.cause), f.op or "", _at(f), f,
                       _rows(f)) for f in report.findings]
    rows += [_group_row(g) for g in section.summarized]
    return rows


def _group_row(group: BadStepGroup) -> BadStepRow:
    at = f"{os.path.basename(group.file)}:{group.line}" if group.file else ""
    return BadStepRow(f"{spans_text(group.steps)} ({group.count} steps)", "summarized",
                      str(group.cause), group.op or "", at, None)


def _rows(f: Finding) -> str:
    """"micro-batch 1: [2]", "batch 14: [3, 7]", "[5]": the rows a loop would filter."""
    where = (f"batch {f.batch_index}" if f.batch_index is not None else
             f"micro-batch {f.micro_batch}" if f.micro_batch is not None else "")
    shown = rows_label(f.samples) or ""
    indices = f.producer.sample_indices if f.producer is not None else None
    if shown and indices:
        shown += f" (data set {rows_label(indices)})"
    return f"{where}: {shown}" if where and shown else where or shown


def _at(f: Finding) -> str:
    return f"{os.path.basename(f.source.file)}:{f.source.line}" if f.source else ""
