"""Where `nanaudit run`'s re-run from the start runs: a scratch copy of the working folder as it
was before the first run, so that the user's files after nanaudit are as the first run left
them (a log the script appends to is not written twice, a checkpoint not rewritten) and what the
first run wrote (a checkpoint the script resumes from) does not change what the re-run does.

The folder's file names are listed before the first run, with the time it started (no sizes,
times or contents: a stat per file made every `run` pay 0.6 s in a folder holding a virtual
environment, for a re-run the in-process replay seldom leaves to do). The copy leaves out what
the first run created (a name not listed); a file the first run changed (modified since it
started) is copied as it is now, and the report says so plainly, as it does when the folder is
too large to copy (the re-run then runs in it)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

MAX_FILES = 20_000
MAX_BYTES = 1 << 30          # a folder larger than this (a dataset) is not copied
_SKIPPED_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"}
# How far the file system's coarse clock may trail time.time_ns() (a tick is 1 to 10 ms).
_CLOCK_SLACK_NS = 20_000_000


@dataclass(frozen=True)
class FolderState:
    """A folder's files before the first run (relative paths), and when that run started."""

    root: str
    files: frozenset
    started_ns: int
    # The top-level files written within the clock's slack before the start (a script or its
    # data written just before `nanaudit run`, as a test does), with their modification times:
    # such a file changed only if its time did, never merely for being recent.
    fresh: tuple = ()

    @staticmethod
    def take(root: str) -> FolderState | None:
        """The listing; None when the folder holds more than MAX_FILES files. Walked with
        `scandir`, whose entries say which are folders without a call each (a stat only for a
        symbolic link, whose target must exist); links to folders are not followed, as
        `os.walk` does not follow them."""
        files: set[str] = set()
        folders = [("", root)]
        while folders:
            prefix, folder = folders.pop()
            try:
                entries = os.scandir(folder)
            except OSError:
                continue
            with entries:
                for entry in entries:
                    try:
                        if entry.is_dir():
                            if entry.name not in _SKIPPED_DIRS and not entry.is_symlink():
                                folders.append((prefix + entry.name + os.sep, entry.path))
                            continue
                        if entry.is_symlink() and not os.path.exists(entry.path):
                            continue            # a broken link: nothing to copy
                    except OSError:
                        continue
                    files.add(prefix + entry.name)
                    if len(files) > MAX_FILES:
                        return None
        started = time.time_ns()
        return FolderState(root, frozenset(files), started, _fresh(root, started))

    def changed(self) -> list[str]:
        """The files the first run changed: modified since it started (the file system's clock
        is coarser than ours: a change in its first _CLOCK_SLACK_NS counts too)."""
        since = self.started_ns - _CLOCK_SLACK_NS
        fresh = dict(self.fresh)
        found = []
        for name in self.files:
            try:
                mtime = os.stat(os.path.join(self.root, name)).st_mtime_ns
                if mtime >= since and fresh.get(name) != mtime:
                    found.append(name)
            except OSError:
                continue
        return sorted(found)

    def size(self) -> int:
        """The listed files' bytes, as they are now."""
        total = 0
        for name in self.files:
            try:
                total += os.stat(os.path.join(self.root, name)).st_size
            except OSError:
                continue
        return total


def _fresh(root: str, started_ns: int) -> tuple:
    """(name, modification time) of the folder's top-level files modified within the clock's
    slack before `started_ns` (a stat each for the top level's few files only)."""
    fresh = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                try:
                    if entry.is_file():
                        mtime = entry.stat().st_mtime_ns
                        if mtime >= started_ns - _CLOCK_SLACK_NS:
                            fresh.append((entry.name, mtime))
                except OSError:
                    continue
    except OSError:
        pass
    return tuple(fresh)


@dataclass(frozen=True)
class Scratch:
    """Where the re-run runs (`folder`) and what the report says of it (`note`, or None)."""

    folder: str
    note: str | None


def prepare(state: FolderState | None, into: Path) -> Scratch:
    """Copy the folder as it was before the first run into `into` (see the module docstring);
    the folder itself when it cannot be copied."""
    here = os.getcwd()
    if state is None or os.path.realpath(state.root) != os.path.realpath(here):
        return Scratch(here, f"the re-run ran in the working folder ({here}), which was too "
                             f"large to list: what the script writes there, it wrote again")
    size = state.size()
    if size > MAX_BYTES:
        return Scratch(here, f"the re-run ran in the working folder ({size / 2**20:.0f} MiB, "
                             f"too large to copy): what the script writes there, it wrote "
                             f"again")
    into.mkdir(parents=True, exist_ok=True)
    for name in state.files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(os.path.join(here, name), target)
        except OSError:
            continue                 # gone since (the script removed it): as the re-run finds it
    changed = state.changed()
    note = None
    if changed:
        shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
        note = (f"the re-run ran in a scratch copy of the working folder, but the first run had "
                f"changed {shown}, which the re-run read as the first run left it")
    return Scratch(str(into), note)


def inside(path: str, state: FolderState | None, scratch: Scratch) -> str:
    """The script's path for the re-run: its copy in the scratch folder when it lies in the
    copied folder (a script writing next to `__file__` writes into the copy); else the path
    made absolute (`../train.py` read from the scratch folder would name nothing)."""
    if state is None or scratch.folder == state.root:
        return path
    full = os.path.abspath(path)
    root = os.path.abspath(state.root)
    if full.startswith(root + os.sep) and os.path.relpath(full, root) in state.files:
        return os.path.join(scratch.folder, os.path.relpath(full, root))
    return full


def relocated(value: Any, scratch: Scratch, root: str) -> Any:
    """`value` (the re-run's finding) with the scratch folder's paths named as the user's
    folder's: the lines it names are the user's files, not their copies."""
    if scratch.folder == root:
        return value
    if isinstance(value, Enum):
        return value
    if isinstance(value, str):
        return value.replace(scratch.folder, root)
    if isinstance(value, (list, tuple)):
        return type(value)(relocated(v, scratch, root) for v in value)
    if isinstance(value, dict):
        return {k: relocated(v, scratch, root) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: relocated(getattr(value, f.name), scratch, root)
                   for f in fields(value) if f.init}
        return replace(value, **changes)
    return value
