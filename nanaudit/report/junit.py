"""JUnit XML: one suite per run, one test case per check; a finding fails its check's case.

Early warnings are one case each: skipped (shown, not failing) by default, failed under
`--fail-on warning`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from nanaudit.report.bad_steps_text import bad_step_rows, bad_steps_line, persistent_line
from nanaudit.report.interface import Renderer
from nanaudit.report.model import Finding, Report
from nanaudit.report.text import finding_facts, finding_message, headline, warning_line

# The sentinel checks, in step order, and the finding `where` each one covers.
CHECKS = (("input", ("input",)), ("parameters", ("parameter",)), ("loss", ("forward",)),
          ("gradients", ("backward",)), ("optimizer update", ("optimizer",)))


def _clean_xml(text: str) -> str:
    """Drop characters XML 1.0 cannot hold (control characters); ElementTree escapes the rest."""
    return "".join(c for c in text if c in "\t\n\r" or ord(c) >= 0x20)


def _bad_steps_properties(report: Report) -> list[tuple[str, str]]:
    if report.bad_steps is None:
        return []
    persistent = persistent_line(report.bad_steps, report.finding)
    return [("bad_steps", bad_steps_line(report.bad_steps))] + (
        [("persistent_cause", persistent)] if persistent else [])


class JunitRenderer(Renderer):
    def render(self, report: Report) -> str:
        suite = ET.Element("testsuite", name="nanaudit", tests=str(len(CHECKS)),
                           time=f"{report.duration_s:.3f}")
        failures = errors = 0
        for name, wheres in CHECKS:
            case = ET.SubElement(suite, "testcase", classname="nanaudit.scan", name=name)
            f = report.finding
            if report.status == "error":
                errors += 1
                ET.SubElement(case, "error", message=_clean_xml(headline(report)))
            elif f is not None and f.where in wheres:
                failures += 1
                failure = ET.SubElement(case, "failure", type=f.cause,
                                        message=_clean_xml(f"{f.value} at step {f.step}: "
                                                           f"{f.cause}"))
                failure.text = _clean_xml(self._details(f))
            elif report.status == "interrupted":
                ET.SubElement(case, "skipped", message="interrupted")
        failures += self._bad_steps(suite, report)
        strict = report.config.get("fail_on") == "warning"
        for w in report.warnings:
            case = ET.SubElement(suite, "testcase", classname="nanaudit.watch",
                                 name=f"{w.kind} at step {w.step}")
            message = _clean_xml(warning_line(w))
            if strict:
                failures += 1
                ET.SubElement(case, "failure", type=w.kind, message=message)
            else:
                ET.SubElement(case, "skipped", message=message)
        suite.set("tests", str(len(CHECKS) + len(report.warnings) + len(bad_step_rows(report))))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
        props = ET.SubElement(suite, "properties")
        for key, value in (("config", report.config.get("path", "")), ("device", report.device),
                           ("torch", report.torch_version), ("steps_run", str(report.steps_run))):
            ET.SubElement(props, "property", name=key, value=_clean_xml(str(value)))
        for key, value in _bad_steps_properties(report):
            ET.SubElement(props, "property", name=key, value=_clean_xml(value))
        if report.timeline_summary is not None:     # a long run: steps in no timeline entry
            ET.SubElement(props, "property", name="timeline_summarized_steps",
                          value=str(report.timeline_summary.steps))
        ET.indent(suite)
        body = ET.tostring(suite, encoding="unicode")
        return '<?xml version="1.0" encoding="utf-8"?>\n' + body + "\n"

    def _bad_steps(self, suite: ET.Element, report: Report) -> int:
        """--keep-going: a failed case per bad step (a summarized group's steps as one)."""
        rows = bad_step_rows(report)
        for row in rows:
            case = ET.SubElement(suite, "testcase", classname="nanaudit.bad_steps",
                                 name=_clean_xml(f"step {row.steps}: {row.cause}"))
            failure = ET.SubElement(case, "failure", type=row.cause, message=_clean_xml(
                f"{row.action}: {row.cause}" + (f" at {row.op}" if row.op else "")
                + (f" ({row.at})" if row.at else "")))
            failure.text = _clean_xml(self._details(row.finding) if row.finding is not None
                                      else f"steps {row.steps}: {row.cause} {row.op} {row.at}")
        return len(rows)

    @staticmethod
    def _details(f: Finding) -> str:
        facts = finding_facts(f)
        lines = [finding_message(f)] + [f"{label}: {value}" for label, value in facts[:-1]]
        if f.source:
            lines.append(f"source: {f.source.file}:{f.source.line}: {f.source.code}")
        lines.append(f"{facts[-1][0]}: {facts[-1][1]}")     # the cause, last
        return "\n".join(lines)
