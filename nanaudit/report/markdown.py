"""A Markdown summary for $GITHUB_STEP_SUMMARY: finding, source line, op inputs, fix, timeline."""

from __future__ import annotations

from nanaudit.report.interface import Renderer
from nanaudit.report.model import Report
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
        if report.error:
            out += ["```", report.error.message, "```", ""]
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
