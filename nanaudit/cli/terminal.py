"""The one owner of the console (hatch's terminal discipline): semantic levels on stderr so
stdout can carry machine formats (`--json -`, GitHub annotations), user strings never parsed as
markup, no progress bar when stderr is not a terminal, and `NO_COLOR` honoured (by rich).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.progress import Progress


class Terminal:
    """Owns the console: semantic levels on stderr, user strings never parsed as markup."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.err = Console(stderr=True, highlight=False, width=_log_width())

    def error(self, message: str) -> None:
        self.err.print(Text("error: ", style="bold red") + Text(message))

    def warning(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text("warning: ", style="bold yellow") + Text(message))

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text(message))

    def success(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text(message, style="bold green"))

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


def _log_width() -> int | None:
    """Not a terminal (a CI log, a pipe) and no COLUMNS: do not wrap at rich's default 80
    columns, which cuts numbers and paths in half. A terminal, or COLUMNS, decides otherwise."""
    if os.environ.get("COLUMNS") or sys.stderr.isatty():
        return None
    return 1000


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
