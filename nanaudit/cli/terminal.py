"""The one owner of the console (hatch's terminal discipline): semantic levels on stderr so
stdout can carry machine formats (`--json -`, GitHub annotations), user strings never parsed as
markup, no progress bar when stderr is not a terminal, and `NO_COLOR` honoured (by rich).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.progress import Progress


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's own points stdout at /dev/null and exits 1: the JSON on stdout and every
        # report not yet written would be lost. The pipe's reader left: say so, exit 9.
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


class Terminal:
    """Owns the console: semantic levels on stderr, user strings never parsed as markup. A
    console that fails (stderr closed or broken, an encoding that cannot print) is noted in
    `failures`, never raised: the reports are written whatever happens to it."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.err = _Console(stderr=True, highlight=False, width=_log_width())
        self.failures: list[str] = []

    def show(self, draw: Callable[[Console], object]) -> str | None:
        """Draw on the console; why it failed, or None (the failure is also noted)."""
        if self.failures:
            return self.failures[0]
        try:
            if sys.stderr is None:
                raise OSError(errno.EBADF, "stderr is closed")
            draw(self.err)
            return None
        except (OSError, ValueError) as exc:     # UnicodeEncodeError is a ValueError
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.failures.append(f"cannot print the console report to stderr: {reason}")
            return self.failures[0]

    # Messages are soft-wrapped (left to the terminal): a path or a command cut in two by a
    # hard line break cannot be copied, and a log's reader searches for it whole.
    def error(self, message: str) -> None:
        line = Text("error: ", style="bold red") + Text(message)
        if self.show(lambda console: console.print(line, soft_wrap=True)) is not None:
            _last_resort(f"nanaudit: error: {message}\n")

    def warning(self, message: str) -> None:
        if not self.quiet:
            self.show(lambda console: console.print(Text("warning: ", style="bold yellow")
                                                    + Text(message), soft_wrap=True))

    def info(self, message: str) -> None:
        if not self.quiet:
            self.show(lambda console: console.print(Text(message), soft_wrap=True))

    def success(self, message: str) -> None:
        if not self.quiet:
            self.show(lambda console: console.print(Text(message, style="bold green")))

    def progress(self) -> Progress | None:
        """A progress bar on stderr, or None when not a terminal or quiet."""
        if self.quiet or not self.err.is_terminal:
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        return Progress(TextColumn("scanning"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=self.err, transient=True)


def _last_resort(text: str) -> None:
    """An error message when stderr failed: on stdout, unless stdout carries machine output."""
    from nanaudit.cli.streams import stdout_is_free
    if stdout_is_free() and sys.stdout is not None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


def _log_width() -> int | None:
    """Not a terminal (a CI log, a pipe) and no COLUMNS: do not wrap at rich's default 80
    columns, which cuts numbers and paths in half. A terminal, or a positive COLUMNS, decides
    otherwise; COLUMNS=0 (or junk), which rich would take as zero columns and print nothing,
    counts as unset."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return None
    tty = False
    try:
        tty = sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError):
        pass
    if not tty:
        return 1000
    return shutil.get_terminal_size((80, 24)).columns if columns else None


def progress_hooks(terminal: Terminal) -> tuple[Progress | None, Callable[[int | None], None],
                                                Callable[[int], None]]:
    """A progress bar (None when quiet) and the on_start / on_step callbacks that drive it."""
    progress = terminal.progress()
    task = {}

    def on_start(total: int | None) -> None:
        if progress:
            progress.start()
            task["id"] = progress.add_task("scan", total=total)

    def on_step(step: int) -> None:
        if progress:
            progress.update(task["id"], completed=step + 1)
    return progress, on_start, on_step
