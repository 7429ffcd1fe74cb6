"""A Markdown summary for $GITHUB_STEP_SUMMARY: finding, source line, op inputs, fix, timeline."""

from __future__ import annotations

from nanaudit.report.bad_steps_text import bad_step_rows, bad_steps_line, persistent_line
from nanaudit.report.interface import Renderer
from nanaudit.report.model import Report
from nanaudit.report.sections import UserCodeFailure
from nanaudit.report.text import (
    describe,
    finding_facts,
    headline,
    sparkline,
    step_marks,
    summary_line,
    warning_line,
)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bad_steps(report: Report) -> list[str]:
    """--keep-going: a table of every bad step (whole findings, then summarized groups)."""
    if report.bad_steps is None:
        return []
    out = [f"**Bad steps:** {_cell(bad_steps_line(report.bad_steps))}", "",
           "| step | update | cause | op | line | rows |", "|---:|---|---|---|---|---|"]
    out += [f"| {_cell(r.steps)} | {_cell(r.action)} | `{_cell(r.cause)}` | {_code(r.op)} | "
            f"{_code(r.at)} | {_cell(r.rows)} |" for r in bad_step_rows(report)]
    persistent = persistent_line(report.bad_steps, report.finding)
    return out + ([""] + [f"**{_cell(persistent)}**"] if persistent else []) + [""]


def _code(text: str) -> str:
    """A user-named string as inline code (backticks inside cannot close it early)."""
    return f"`{_cell(text).replace('`', chr(0x2018))}`" if text else ""


class MarkdownRenderer(Renderer):
    def render(self, report: Report) -> str:
        icon = {"clean": "✅", "nonfinite": "❌"}.get(report.status, "⚠️")
        out = [f"## {icon} nanaudit: {_cell(headline(report))}", "",
               f"Config `{report.config.get('path', '')}` · device `{report.device}` · "
               f"torch `{report.torch_version}` · {report.steps_run} step(s)", ""]
        f = report.finding
        if f is not None:
            out += ["| | |", "|---|---|"]
            out += [f"| {label} | {_cell(f'`{value}`' if label == 'cause' else value)} |"
                    for label, value in finding_facts(f)]
            out.append("")
            if f.source:
                out += [f"**Source** `{f.source.file}:{f.source.line}`", "", "```python",
                        f.source.code, "```", ""]
            if f.inputs:
                out += ["**Inputs of the op**", "", "| input | stats |", "|---|---|"]
                out += [f"| {_cell(s.name)} | `{_cell(describe(s))}` |" for s in f.inputs]
                out.append("")
            out += [f"**Why:** {_cell(f.explanation)}", "", f"**Fix:** {_cell(f.fix)}", ""]
        out += _bad_steps(report)
        if report.error:
            out += ["```", report.error.message, "```", ""]
            if isinstance(report.error, UserCodeFailure) and report.error.hint:
                out += [f"**Hint:** {_cell(report.error.hint)}", ""]
        if report.warnings:
            out += [f"**Early warnings** ({len(report.warnings)})", ""]
            out += [f"- {_cell(warning_line(w))}" for w in report.warnings]
            out.append("")
        if report.timeline:
            tail = report.timeline[-40:]
            out += ["**Timeline** (last steps)", "",
                    f"- loss `{sparkline([e.loss for e in tail])}`",
                    f"- grad norm `{sparkline([e.grad_norm for e in tail], log=True)}`"]
            marks = step_marks(tail, report.warnings, report.finding)
            if marks:
                out.append(f"- marks &nbsp;&nbsp;&nbsp;`{marks}` (▲ warning, s skipped, ✗ finding)")
            summary = report.timeline_summary
            if summary is not None and summary.buckets:
                out.append(f"- earlier: {_cell(summary_line(summary))}")
            out.append("")
        return "\n".join(out) + "\n"
