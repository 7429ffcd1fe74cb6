"""A warning torch raises in an op the script's own code called is shown at the script's line,
as without nanaudit.

The step's record runs the script's loss code through a torch function mode, so the innermost
Python frame of such an op is nanaudit's (`func(*args)` in the mode): a warning torch raises
there (`var(): degrees of freedom is <= 0`, a deprecation) would name nanaudit's file and line.
`warnings.showwarning` runs while that stack is still live, so the innermost frame of the
script's own files on it is the line that called the op.

Python decided whether to show it before that, by nanaudit's line: under the default action
(once per location) the same warning from a second line of the script would not be shown. So
where that action left its mark in nanaudit's module's registry, the mark is taken back and the
decision made again by the script's line, as Python would have made it without nanaudit."""

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
    once = OncePerLine()

    def showwarning(message: Any, category: Any, filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
        if is_own_file(filename):
            site = _script_line(filename)
            if site is not None:
                if once.seen(site, (str(message), category, lineno)):
                    return
                filename, lineno, line = site[0], site[1], None
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning

    def restore() -> None:
        if warnings.showwarning is showwarning:
            warnings.showwarning = shown
    return restore


class OncePerLine:
    """The default action's "once per location", keyed by the script's line."""

    def __init__(self) -> None:
        self._shown: set[tuple] = set()
        self._version: Any = None       # the registry's: a change of the filters resets it

    def seen(self, site: tuple[str, int, dict], key: tuple) -> bool:
        """Whether the warning `key` (text, category, nanaudit's line) was shown already at
        the script's line of `site`; the registry's mark of nanaudit's line is taken back."""
        file, line, registry = site
        if not registry.get(key):     # an action that keeps no mark of it ("always")
            return False
        del registry[key]                     # so the same warning from another line comes
        if registry.get("version") != self._version:
            self._shown, self._version = set(), registry.get("version")
        mark = (key[0], key[1], file, line)
        if mark in self._shown:
            return True
        self._shown.add(mark)
        return False


def _script_line(named: str) -> tuple[str, int, dict] | None:
    """(file, line) of the innermost frame of the script's own code outside the frame of
    nanaudit's file `named`, which the warning named, and the warning registry of that
    nanaudit frame's module (where Python marked the warning as shown)."""
    frame: Any = sys._getframe(2)     # past this module's and the warnings module's frames
    while frame is not None and frame.f_code.co_filename != named:
        frame = frame.f_back
    registry = frame.f_globals.get("__warningregistry__", {}) if frame is not None else {}
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno, registry
        frame = frame.f_back
    return None
