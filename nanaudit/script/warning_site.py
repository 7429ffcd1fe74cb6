"""A warning torch raises in an op the script's own code called is shown at the script's line,
as without nanaudit.

The step's record runs the script's loss code through a torch function mode, so the innermost
Python frame of such an op is nanaudit's (`func(*args)` in the mode): a warning torch raises
there (`var(): degrees of freedom is <= 0`, a deprecation) would name nanaudit's file and line.
`warnings.showwarning` runs while that stack is still live, so the innermost frame of the
script's own files on it is the line that called the op."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from nanaudit.errors import is_own_file
from nanaudit.run.loss_code import is_user_file


def show_at_script_lines() -> Callable[[], None]:
    """Install the re-attribution; returns what removes it (leaving a later replacement, the
    script's own, in place)."""
    shown = warnings.showwarning

    def showwarning(message: Any, category: Any, filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
        if is_own_file(filename):
            site = _script_line(filename)
            if site is not None:
                filename, lineno, line = site[0], site[1], None
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning

    def restore() -> None:
        if warnings.showwarning is showwarning:
            warnings.showwarning = shown
    return restore


def _script_line(named: str) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of the script's own code outside the frame of
    nanaudit's file `named`, which the warning named."""
    frame: Any = sys._getframe(2)     # past this module's and the warnings module's frames
    while frame is not None and frame.f_code.co_filename != named:
        frame = frame.f_back
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None
