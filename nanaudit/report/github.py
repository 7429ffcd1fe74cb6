"""GitHub Actions workflow commands: an ::error annotation on the user's source line, and a
::warning per early warning (::error under `--fail-on warning`)."""

from __future__ import annotations

import os

from nanaudit.report.bad_steps_text import bad_steps_line, persistent_line, spans_text
from nanaudit.report.interface import Renderer
from nanaudit.report.model import Report
from nanaudit.report.text import finding_message, headline, warning_line


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _relative(path: str) -> str:
    return os.path.relpath(path) if os.path.isabs(path) else path


class GithubRenderer(Renderer):
    def render(self, report: Report) -> str:
        level = "error" if report.config.get("fail_on") == "warning" else "warning"
        warnings = "".join(f"::{level} title={_escape_property(f'nanaudit ({w.kind})')}::"
                           f"{_escape_data(warning_line(w))}\n" for w in report.warnings)
        if report.bad_steps is not None:
            return warnings + self._bad_steps(report)
        return warnings + self._finding(report)

    def _bad_steps(self, report: Report) -> str:
        """--keep-going: one ::error per distinct line the bad steps name (steps that name no
        line, one per cause), with how many steps and which."""
        assert report.bad_steps is not None
        lines: dict[tuple[str, int | None, str], list] = {}
        for f in report.findings:
            key = (f.source.file, f.source.line, str(f.cause)) if f.source else ("", None,
                                                                                  str(f.cause))
            lines.setdefault(key, []).append(str(f.step))
        for g in report.bad_steps.summarized:
            lines.setdefault((g.file or "", g.line if g.file else None, str(g.cause)),
                             []).append(spans_text(g.steps))
        out = []
        for (file, line, cause), steps in lines.items():
            props = [f"file={_escape_property(_relative(file))}", f"line={line}"] if file else []
            props.append(f"title={_escape_property(f'nanaudit ({cause})')}")
            message = (f"{cause} at step(s) {', '.join(steps)}; "
                       f"{bad_steps_line(report.bad_steps)}")
            out.append(f"::error {','.join(props)}::{_escape_data(message)}\n")
        persistent = persistent_line(report.bad_steps, report.finding)
        if persistent:
            out.append(f"::error title=nanaudit (persistent cause)::{_escape_data(persistent)}\n")
        return "".join(out)

    def _finding(self, report: Report) -> str:
        f = report.finding
        if report.status == "clean":
            return f"::notice title=nanaudit::{_escape_data(headline(report))}\n"
        if f is None:
            return f"::error title=nanaudit ({report.status})::{_escape_data(headline(report))}\n"
        props = []
        if f.source:
            props += [f"file={_escape_property(_relative(f.source.file))}",
                      f"line={f.source.line}"]
        props.append(f"title={_escape_property(f'nanaudit ({f.cause})')}")
        return f"::error {','.join(props)}::{_escape_data(finding_message(f))}\n"
