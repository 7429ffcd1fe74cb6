"""GitHub Actions workflow commands: an ::error annotation on the user's source line, and a
::warning per early warning (::error under `--fail-on warning`)."""

from __future__ import annotations

import os

from nanaudit.report.interface import Renderer
from nanaudit.report.model import Report
from nanaudit.report.text import finding_message, headline, warning_line


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


class GithubRenderer(Renderer):
    def render(self, report: Report) -> str:
        level = "error" if report.config.get("fail_on") == "warning" else "warning"
        warnings = "".join(f"::{level} title={_escape_property(f'nanaudit ({w.kind})')}::"
                           f"{_escape_data(warning_line(w))}\n" for w in report.warnings)
        return warnings + self._finding(report)

    def _finding(self, report: Report) -> str:
        f = report.finding
        if report.status == "clean":
            return f"::notice title=nanaudit::{_escape_data(headline(report))}\n"
        if f is None:
            return f"::error title=nanaudit ({report.status})::{_escape_data(headline(report))}\n"
        props = []
        if f.source:
            path = os.path.relpath(f.source.file) if os.path.isabs(f.source.file) else f.source.file
            props += [f"file={_escape_property(path)}", f"line={f.source.line}"]
        props.append(f"title={_escape_property(f'nanaudit ({f.cause})')}")
        return f"::error {','.join(props)}::{_escape_data(finding_message(f))}\n"
