"""Every format renders a run that kept going: all its bad steps, what became of each, the
summary, the persistent cause; every user-named string escaped. Golden files as for the
single-finding report (regenerate with NANAUDIT_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import io
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from keep_going_case import HOSTILE, bad_step, keep_going_report
from rich.console import Console

from nanaudit.report.bad_steps import KEEP_WHOLE, BadStepLog
from nanaudit.report.console import print_report
from nanaudit.report.formats import renderer_for
from nanaudit.report.html_text import embedded_json
from nanaudit.report.model import Report
from nanaudit.report.vocabulary import BadStepAction, StopReason

GOLDEN = Path(__file__).parent / "golden"
FORMATS = {"json": "keep_going.json", "junit": "keep_going.xml",
           "github": "keep_going.github.txt", "markdown": "keep_going.md"}


def _golden(name: str, text: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("NANAUDIT_UPDATE_GOLDEN"):
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


def _console(report: Report) -> str:
    out = io.StringIO()
    print_report(report, Console(file=out, width=100, force_terminal=False, color_system=None,
                                 highlight=False))
    return out.getvalue()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_matches_golden(fmt):
    _golden(FORMATS[fmt], renderer_for(fmt).render(keep_going_report()))


def test_console_matches_golden():
    _golden("keep_going.console.txt", _console(keep_going_report()))


def test_the_json_timeline_marks_each_bad_step():
    body = json.loads(renderer_for("json").render(keep_going_report()))
    marks = {e["step"]: e.get("bad") for e in body["timeline"]}
    assert marks == {0: None, 1: None, 2: None, 3: "skipped", 4: None, 5: "skipped", 6: None,
                     7: None, 8: "stopped"}


def test_junit_has_a_failed_case_per_bad_step():
    suite = ET.fromstring(renderer_for("junit").render(keep_going_report()))
    cases = [c for c in suite if c.get("classname") == "nanaudit.bad_steps"]
    assert [c.get("name") for c in cases] == ["step 3: log-domain", "step 5: nonfinite-input",
                                              "step 8: log-domain"]
    assert all(c.find("failure") is not None for c in cases)
    assert int(suite.get("tests")) == 5 + 3


def test_github_gives_one_annotation_per_distinct_line():
    text = renderer_for("github").render(keep_going_report())
    errors = [line for line in text.splitlines() if line.startswith("::error")]
    # log(0) at one line (steps 3 and 8) and the input with no line: two annotations.
    assert len(errors) == 2
    assert "line=17" in errors[0] and "step(s) 3, 8" in errors[0]
    assert "file=" not in errors[1] and "nonfinite-input" in errors[1]
    # A hostile file name cannot open a new command or property.
    assert all(line.count("::") == 2 for line in errors)


def test_html_has_a_table_of_bad_steps_each_expandable_and_escaped():
    page = renderer_for("html").render(keep_going_report())
    section = page[page.index('<section id="bad-steps">'):]
    section = section[:section.index("</section>")]
    table = section[section.index("<table>"):section.index("</table>")]
    assert table.count("<tr>") == 1 + 3 and section.count("<details>") == 3
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    assert '<a href="#bad-steps">bad steps</a>' in page
    assert json.loads(embedded_json(page))["bad_steps"]["count"] == 3
    svg_skips = re.findall(r'<line class="skip bad-step"[^>]*><title>step (\d+)', page)
    assert svg_skips == ["3", "5"]


def test_every_format_states_a_persistent_cause_and_the_summary():
    log = BadStepLog(max_bad_steps=50)
    for step in range(40):
        log.record(bad_step(10 + step), BadStepAction.SKIPPED)
    log.record(bad_step(50), BadStepAction.STOPPED, StopReason.MAX_BAD_STEPS)
    report = Report(tool_version="0.1.0", config={}, torch_version="2.13.0", device="cpu",
                    status="nonfinite", steps_run=51)
    log.apply(report)
    assert report.bad_steps is not None and report.bad_steps.persistent
    texts = {fmt: renderer_for(fmt).render(report) for fmt in ("markdown", "github", "junit")}
    texts["console"] = _console(report)
    texts["html"] = renderer_for("html").render(report)
    for fmt, text in texts.items():
        assert "persistent cause" in text, fmt
        assert f"the other {41 - KEEP_WHOLE} summarized" in text, fmt
        assert "30-50" in text or "30-49" in text, fmt
    assert HOSTILE not in texts["html"]
