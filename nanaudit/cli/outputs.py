"""The outputs a command writes, from one table of formats (name -> renderer, option, wording).

Every requested output is checked before the run (a path that cannot be written is exit 9
before any step; --plot without matplotlib is exit 2), and a failure to write one after it is
exit 9 whatever the scan found: CI must never read a stale report from an earlier run and pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanaudit.cli.process import code_of, exit_with
from nanaudit.cli.streams import STDERR, reserve_stdout, write_stderr, write_stdout
from nanaudit.cli.terminal import Terminal
from nanaudit.exitcodes import ExitCode
from nanaudit.report.vocabulary import Status

if TYPE_CHECKING:
    from nanaudit.report.model import Report


def _rendered_by(name: str) -> Callable[[Report], str]:
    """The text of the report renderer `name` (report.formats)."""
    def render(report: Report) -> str:
        from nanaudit.report.formats import renderer_for
        return renderer_for(name).render(report)
    return render


def _png(report: Report) -> bytes:
    from nanaudit.report.plot import render_png
    return render_png(report)


def _plot_available() -> None:
    from nanaudit.report.plot import check_available
    check_available()


@dataclass(frozen=True)
class Format:
    """One way to write a report: its renderer, the option asking for it (None: chosen by
    `--format`, written to stdout), how messages name it, and what it needs installed."""

    name: str
    what: str
    render: Callable[[Report], str | bytes]
    option: str | None = None
    param: str | None = None             # click's parameter name for the option
    metavar: str = "PATH"
    help: str = ""
    quiets_console: bool = False         # on stdout, the console report steps aside
    requires: Callable[[], None] | None = None   # raises PlotUnavailable when missing


FORMATS = (
    Format("json", "the json report", _rendered_by("json"), "--json", "json_path",
           help="Write the JSON report to PATH ('-' for stdout).", quiets_console=True),
    Format("junit", "the junit report", _rendered_by("junit"), "--junit-xml", "junit_path",
           help="Write a JUnit XML report."),
    Format("markdown", "the markdown report", _rendered_by("markdown"), "--markdown",
           "markdown_path", help="Write a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)."),
    Format("html", "the html report", _rendered_by("html"), "--html", "html_path",
           help="Write a self-contained HTML report (timeline, source, rows; opens offline)."),
    Format("github", "the github annotations", _rendered_by("github")),
    Format("plot", "the plot", _png, "--plot", "plot_path", "PATH.png",
           help="Draw loss, gradient norm, update ratio and activation maxima against steps, "
                "warnings and the finding marked (needs matplotlib: "
                "pip install 'nanaudit[plot]').", requires=_plot_available),
)
"""Every output format, in the order they are written."""


STREAM_FORMATS = ("console", *(f.name for f in FORMATS if f.option is None))
"""`--format`: the console report alone, or also a stdout format (github: ::error lines)."""


@dataclass(frozen=True)
class Requested:
    """The outputs a command was asked for: (format, destination) pairs; '-' is stdout.
    `empty`: the options given an empty path (an unset CI variable), refused by check()."""

    writes: tuple[tuple[Format, str], ...]
    empty: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Requested:
        """From a command's click parameters; `--format` defaults to github under Actions."""
        stream = options.get("fmt")
        if stream is None and os.environ.get("GITHUB_ACTIONS") == "true":
            stream = "github"
        writes, empty = [], []
        for fmt in FORMATS:
            destination = options.get(fmt.param) if fmt.param else (
                "-" if stream == fmt.name else None)
            if destination:
                writes.append((fmt, absolute(str(destination))))
            elif destination is not None and fmt.option:
                empty.append(fmt.option)
        if any(fmt.quiets_console and dest == "-" for fmt, dest in writes):
            # stdout carries the JSON alone: the annotations go to stderr (Actions reads both).
            writes = [(fmt, STDERR if dest == "-" and fmt.option is None else dest)
                      for fmt, dest in writes]
        return cls(tuple(writes), tuple(empty))

    @property
    def quiets_console(self) -> bool:
        return any(fmt.quiets_console and dest == "-" for fmt, dest in self.writes)

    def files(self) -> list[str]:
        return [dest for _, dest in self.writes if dest not in ("-", STDERR)]

    def without(self, name: str) -> Requested:
        return Requested(tuple((fmt, dest) for fmt, dest in self.writes if fmt.name != name))

    def relocated(self, move: Callable[[str], str | None]) -> Requested:
        """Each option's destination moved (`move` returning None drops it)."""
        writes = [(fmt, move(dest) if fmt.param else dest) for fmt, dest in self.writes]
        return Requested(tuple((fmt, dest) for fmt, dest in writes if dest))

    def check(self, terminal: Terminal, also: Mapping[str, str | None] | None = None,
              folder: str | None = None) -> None:
        """Refuse, before any step runs, two outputs on one path or an empty one (a usage
        error), then outputs that cannot be written (and `also`, a command's own files by
        option, and its `folder`: --repro); then keep stdout for the JSON report when it goes
        there."""
        from nanaudit.report.output import output_problem
        from nanaudit.report.plot import PlotUnavailable
        own = {option: absolute(path) if path else path for option, path in (also or {}).items()
               if path is not None}
        _refuse(terminal, self.usage_problems(own, folder), ExitCode.USAGE)
        paths = dict.fromkeys([*self.files(), *(p for p in own.values() if p and p != "-")])
        problems = [f"cannot write {p}: {problem}" for p in paths
                    if (problem := output_problem(p))]
        if folder and (problem := output_problem(absolute(folder), folder=True)):
            problems.append(f"cannot write the repro bundle to {folder}: {problem}")
        _refuse(terminal, problems, ExitCode.OUTPUT)
        for fmt, _ in self.writes:
            try:
                if fmt.requires is not None:
                    fmt.requires()
            except PlotUnavailable as exc:
                terminal.error(str(exc))
                exit_with(ExitCode.USAGE)
        if self.quiets_console:
            reserve_stdout()

    def usage_problems(self, own: Mapping[str, str], folder: str | None) -> list[str]:
        """Two outputs on one path (or both on stdout: the last would silently win), and
        empty paths; `own`: a command's own files by option, `folder`: --repro."""
        named = [*((fmt.option or f"--format {fmt.name}", dest) for fmt, dest in self.writes),
                 *((option, path) for option, path in own.items() if path),
                 *([("--repro", absolute(folder))] if folder else [])]
        taken: dict[str, str] = {}
        problems = []
        for option, destination in named:
            where = destination if destination == "-" else os.path.realpath(destination)
            if where in taken:
                problems.append(f"{taken[where]} and {option} both write "
                                f"{'stdout' if where == '-' else destination}: give each its "
                                f"own path")
            taken.setdefault(where, option)
        empty = [*self.empty, *(o for o, p in own.items() if not p),
                 *(["--repro"] if folder == "" else [])]
        return problems + [f"{option}: an empty path (an unset variable?); give a file name"
                           for option in empty]

    def emit(self, report: Report, terminal: Terminal) -> list[str]:
        """Write every requested output, the files first, then print the console report (a
        console that fails cannot cost a file); returns the outputs that failed to write (a
        console failure stays in `terminal.failures`, which final_code reads)."""
        from nanaudit.report.plot import PlotUnavailable
        failed, saved = [], set()
        for fmt, destination in sorted(self.writes, key=lambda w: w[1] in ("-", STDERR)):
            try:
                data = fmt.render(report)
            except PlotUnavailable as exc:
                failed.append(str(exc))
                continue
            problem = write(fmt.what, destination, data)
            if problem:
                failed.append(problem)
            else:
                saved.add(fmt.name)
        if not terminal.quiet:        # the console renderer's imports only when it prints
            from nanaudit.report.console import print_report
            terminal.show(lambda console: print_report(report, console, frozenset(saved)))
        elif report.status == Status.ERROR and report.error:
            terminal.error(report.error.message)
        return failed


def _refuse(terminal: Terminal, problems: list[str], code: ExitCode) -> None:
    """Before the run: every problem said, then the exit."""
    for problem in problems:
        terminal.error(problem)
    if problems:
        exit_with(code)


def absolute(destination: str) -> str:
    """A destination resolved at start-up: user code that calls `os.chdir` must not move the
    reports into its new folder (where they could overwrite its files); '-' stays stdout."""
    return destination if destination == "-" else os.path.abspath(destination)


def write(what: str, destination: str, data: str | bytes) -> str | None:
    """Write `data` atomically to the file `destination`, or text to stdout when it is '-'
    (stderr: STDERR; bytes, a PNG or the skip list, always go to a file); the failure
    message, or None. Text is UTF-8; a lone surrogate (a file name os.listdir could not
    decode, in a user's message) is written escaped, never a failure."""
    from nanaudit.report.output import encoded, write_atomic_bytes
    raw = encoded(data) if isinstance(data, str) else data
    try:
        if destination == "-" and isinstance(data, str):
            write_stdout(raw)
        elif destination == STDERR:
            write_stderr(raw)
        else:
            write_atomic_bytes(destination, raw)
    except OSError as exc:      # a closed pipe (`| head`), a full disk: it did not arrive
        where = {"-": "stdout", STDERR: "stderr"}.get(destination, destination)
        return f"cannot write {what} to {where}: {exc.strerror or str(exc)}"
    return None


def final_code(report: Report, failed: list[str], terminal: Terminal) -> ExitCode:
    """The report's exit code, unless a requested output (the console report among them)
    could not be written."""
    failed = [*failed, *(f for f in terminal.failures if f not in failed)]
    if not failed:
        return code_of(report)
    for message in failed:
        terminal.error(message)
    terminal.error(f"exit {int(ExitCode.OUTPUT)}: {len(failed)} requested output(s) could not "
                   f"be written; the scan itself ended {report.status} "
                   f"(exit {int(code_of(report))})")
    return ExitCode.OUTPUT
