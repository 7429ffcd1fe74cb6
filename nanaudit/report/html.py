"""`--html PATH`: one self-contained page per run, the CI artifact a reviewer opens.

In the order a person needs it: the verdict (status, step, rank, batch, samples, cause, the
fix), the timeline, the finding (the op, the module, the user's line among its neighbours, the
op's inputs, why), the chain of ops to the check, the offending rows, bisect's batches or
checkpoint search, each rank, the script's runs, the early warnings, the error, then the
environment and how to reproduce. The JSON report, exactly as `--json` writes it, is embedded
(and downloadable from the page). A clean run is the verdict and the timeline.

The page opens with no network and no server: style, script and charts are inline, nothing
is referenced, and the content is complete without script. Every string the user's program
named goes through html_text.esc and the JSON through html_text.embed_json; the page's
Content-Security-Policy admits only its own style and script, by hash.
"""

from __future__ import annotations

from nanaudit.report.html_finding import finding_sections
from nanaudit.report.html_sections import (
    bad_steps_section,
    bisect_section,
    environment_section,
    error_section,
    ranks_section,
    script_section,
    warnings_section,
)
from nanaudit.report.html_style import CONTENT_SECURITY_POLICY, SCRIPT, STYLE
from nanaudit.report.html_svg import timeline_svgs
from nanaudit.report.html_text import EMBEDDED_JSON_ID, embed_json, esc
from nanaudit.report.interface import Renderer
from nanaudit.report.json import JsonRenderer
from nanaudit.report.model import Report
from nanaudit.report.sections import DataBisect
from nanaudit.report.text import finding_facts, headline, summary_line

MARK = {"clean": "✓", "nonfinite": "✗"}
VERDICT_FACTS = ("step", "batch", "rank", "samples", "cause")
"""The finding's facts the verdict shows (labels of text.finding_facts), the rest below."""


class HtmlRenderer(Renderer):
    def render(self, report: Report) -> str:
        return render_html(report)


def render_html(report: Report) -> str:
    """The page; always encodable as UTF-8 (esc shows what could not be)."""
    sections = [_timeline(report)]
    if report.finding is not None:
        sections += finding_sections(report.finding)
    sections += [bad_steps_section(report), bisect_section(report.bisect),
                 ranks_section(report.distributed,
                               report.finding.rank if report.finding is not None else None),
                 script_section(report.run), warnings_section(report), error_section(report),
                 environment_section(report), _json_section(report)]
    sections = [s for s in sections if s]
    title = f"nanaudit: {headline(report)}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="nanaudit {esc(report.tool_version)}">'
            f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n<body><main>"
            + _verdict(report) + _nav(sections) + "\n".join(sections)
            + f'<footer>nanaudit {esc(report.tool_version)} · schema version 1 · this page '
              f'loads nothing: everything it shows is in this file.</footer></main>\n'
            + f'<script type="application/json" id="{EMBEDDED_JSON_ID}">'
            + embed_json(JsonRenderer().render(report)) + "</script>\n"
            + f"<script>{SCRIPT}</script></body></html>\n")


def _verdict(report: Report) -> str:
    status = str(report.status)
    where = report.config.get("path") or report.config.get("api") or ""
    parts = [f'<header class="verdict {esc(status)}"><p class="tool">nanaudit '
             f'{esc(report.tool_version)} · {esc(report.command)} · '
             f'<span class="mono">{esc(where)}</span></p>'
             f"<h1>{MARK.get(status, '!')} {esc(headline(report))}</h1>"]
    f = report.finding
    facts = [("status", status)]
    if f is not None:
        facts += [(label, value) for label, value in finding_facts(f)
                  if label in VERDICT_FACTS]
    else:
        facts.append(("steps audited", str(report.steps_run)))
    if isinstance(report.bisect, DataBisect):
        facts.append(("bad batches", f"{len(report.bisect.bad_batches)} of "
                                     f"{report.bisect.batches_audited}"))
    if report.warnings:
        facts.append(("early warnings", str(len(report.warnings))))
    parts.append('<dl class="facts">' + "".join(
        f"<div><dt>{esc(label)}</dt><dd>{esc(value)}</dd></div>" for label, value in facts)
        + "</dl>")
    if f is not None:
        where_made = (f"{f.op} in {f.module or '(root)'}" if f.op else
                      f"{f.where} {f.tensor or ''}".strip())
        line = f" at {f.source.file}:{f.source.line}" if f.source else ""
        parts.append(f'<p class="mono">{esc(where_made)}{esc(line)}</p>')
        parts.append(f'<p class="fix"><b>fix</b> {esc(f.fix)}</p>')
    return "".join(parts) + "</header>"


def _timeline(report: Report) -> str:
    figures = timeline_svgs(report)
    if not figures:
        return ""
    steps = [e.step for e in report.timeline]
    legend = ('<p class="legend muted"><span class="bad">│ finding</span>'
              '<span class="warn">┆ early warning</span><span class="bad">✕ non-finite</span>'
              '<span>hover a point for its value</span></p>')
    summary = report.timeline_summary
    summarized = (f'<p class="muted">{esc(summary_line(summary))}: each a band from its min '
                  f'to its max</p>' if summary is not None and summary.buckets else "")
    return (f'<section id="timeline"><h2>Timeline: steps {min(steps)} to {max(steps)}</h2>'
            f'{legend}{summarized}<div id="readout" aria-live="polite"></div>'
            f'{"".join(figures)}</section>')


def _json_section(report: Report) -> str:
    return ('<section id="json"><h2>The JSON report</h2><p>This page carries the JSON report '
            'exactly as <code>--json</code> writes it, in the '
            f'<code>&lt;script id="{EMBEDDED_JSON_ID}"&gt;</code> element. '
            '<button id="download" type="button" hidden>download nanaudit.json</button></p>'
            '</section>')


NAV_TITLES = {"timeline": "timeline", "finding": "finding", "chain": "chain", "rows": "rows",
              "bad-steps": "bad steps",
              "bisect": "bisect", "ranks": "ranks", "script": "script", "warnings": "warnings",
              "error": "error", "environment": "environment", "json": "JSON"}


def _nav(sections: list[str]) -> str:
    anchors = [s.split('"', 2)[1] for s in sections if s.startswith('<section id="')]
    links = " ".join(f'<a href="#{a}">{NAV_TITLES.get(a, a)}</a>' for a in anchors)
    return f'<nav aria-label="sections">{links} <span class="muted">(j / k)</span></nav>'
