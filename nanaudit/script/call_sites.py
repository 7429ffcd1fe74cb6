"""The script's lines an update trip names (script/update_replay.py): where it built each
optimizer (its hyper-parameters, the line a fix edits) and where it called the step that made
the value (`optimizer.step()`, `scaler.step(optimizer)`, `trainer.fit(...)`).

The user's line is the innermost frame of the script's own code: not torch's, not nanaudit's,
and not an installed library's (the Trainer's, Accelerate's and Lightning's frames sit between
the script and the step); with no such frame, the innermost frame outside torch and nanaudit,
the tracer's rule. The build is walked once per optimizer. The step is heard on every clean
step, so it costs C-level frame lookups and a dict store, nothing formatted: how many frames
out from the step's caller the script's frame lies is learned once per caller's code (and
learned again when the frame found there is not the script's: a library's code reached at two
depths, a `step` wrapper called by the script itself and through a helper of the library), and
the step keeps that frame's code and line number only (a reference), read into a line at a
trip."""

from __future__ import annotations

import functools
import linecache
import os
import sys
from types import CodeType, FrameType
from typing import Any

import torch

from nanaudit.errors import is_own_file
from nanaudit.report.model import SourceLine

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
Site = tuple[CodeType, int]


class CallSites:
    """The build and latest step call of each optimizer, by id, as (code, line)."""

    def __init__(self) -> None:
        # step caller's code -> (frames out to the script, the owner of the frame found there)
        self._hops: dict[CodeType, tuple[int, str]] = {}
        self._steps: dict[int, Site] = {}
        self._built: dict[int, Site] = {}

    def built(self, optimizer: Any, depth: int) -> None:
        """`optimizer` is being built; the frame `depth` out from the caller is inside the
        build (walked outward to the script's frame: once per optimizer)."""
        frame = sys._getframe(depth + 1)
        for _ in range(_hops_to_script(frame)[0]):
            frame = frame.f_back or frame
        self._built[id(optimizer)] = (frame.f_code, frame.f_lineno)

    def stepped(self, optimizer: Any, depth: int) -> None:
        """`optimizer`'s step was called from the frame `depth` out from the caller (a clean
        step's cost: see the module docstring)."""
        caller = sys._getframe(depth + 1)
        learned = self._hops.get(caller.f_code)
        frame = _out(caller, depth + 1, learned)
        if frame is None or learned is None or _owner(frame.f_code.co_filename) != learned[1]:
            learned = self._hops[caller.f_code] = _hops_to_script(caller)
            frame = _out(caller, depth + 1, learned)
            if frame is None:
                return
        self._steps[id(optimizer)] = (frame.f_code, frame.f_lineno)

    def step_line(self, optimizer: Any) -> SourceLine | None:
        """The script's line that called `optimizer`'s latest step (None: not heard)."""
        return _line(self._steps.get(id(optimizer)))

    def built_line(self, optimizer: Any) -> SourceLine | None:
        """The script's line that built `optimizer` (None: built before the hooks)."""
        return _line(self._built.get(id(optimizer)))


def where(line: SourceLine) -> str:
    """`train.py:21`, as the console's hints name a line."""
    return f"{os.path.basename(line.file)}:{line.line}"


def _line(site: Site | None) -> SourceLine | None:
    if site is None:
        return None
    code, line = site
    text = linecache.getline(code.co_filename, line).strip()
    return SourceLine(code.co_filename, line, text, code.co_name)


def _out(caller: FrameType, depth: int, learned: tuple[int, str] | None) -> FrameType | None:
    """The frame `learned[0]` out from `caller` (`depth` out from this function's caller's
    frame), by one C-level lookup; None when the stack is shallower or nothing is learned."""
    if learned is None:
        return None
    try:
        return sys._getframe(depth + 1 + learned[0]) if learned[0] else caller
    except ValueError:
        return None


def _hops_to_script(frame: FrameType) -> tuple[int, str]:
    """(how many frames out from `frame` the script's own frame lies, "script"), see the
    module docstring; (the innermost library frame's, "library") when no frame is the
    script's, else (0, the owner of `frame`)."""
    fallback, hops = None, 0
    current: FrameType | None = frame
    while current is not None:
        kind = _owner(current.f_code.co_filename)
        if kind == "script":
            return hops, kind
        if kind == "library" and fallback is None:
            fallback = hops
        current, hops = current.f_back, hops + 1
    if fallback is not None:
        return fallback, "library"
    return 0, _owner(frame.f_code.co_filename)


@functools.lru_cache(maxsize=1024)
def _owner(name: str) -> str:
    """"skip" (torch, nanaudit, frozen modules), "library" (installed packages and the
    standard library) or "script"."""
    path = os.path.abspath(name)
    if path.startswith(_TORCH_DIR) or name.startswith("<frozen") or is_own_file(path):
        return "skip"
    return "library" if path.startswith(_library_dirs()) else "script"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    # imported at the first step only: a clean run's start-up does not pay for it
    import sysconfig
    paths = sysconfig.get_paths()
    return tuple(os.path.abspath(paths[key]) + os.sep
                 for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key))
