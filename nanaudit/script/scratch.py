"""Where `nanaudit run`'s re-run from the start runs: a scratch copy of the working folder as it
was before the first run, so that the user's files after nanaudit are as the first run left
them (a log the script appends to is not written twice, a checkpoint not rewritten) and what the
first run wrote (a checkpoint the script resumes from) does not change what the re-run does.

The folder is listed (names, sizes, modification times; no contents) before the first run. The
copy leaves out what the first run created; a file the first run changed is copied as it is
now, and the report says so plainly, as it does when the folder is too large to copy (the
re-run then runs in it)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

MAX_FILES = 20_000
MAX_BYTES = 1 << 30          # a folder larger than this (a dataset) is not copied
_SKIPPED_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"}


@dataclass(frozen=True)
class FolderState:
    """A folder's files before the first run: relative path -> (size, mtime_ns)."""

    root: str
    files: dict

    @staticmethod
    def take(root: str) -> FolderState | None:
        """The listing; None when the folder holds more than MAX_FILES files. Walked with
        `scandir` (a folder's entries say which are folders without a call each), as
        `os.walk` does but without its per-file path joins: this runs before every script,
        and a dataset folder makes it list MAX_FILES files before giving up (0.45 -> 0.22 s).
        Symbolic links to folders are not followed, as `os.walk` does not follow them."""
        files: dict[str, tuple[int, int]] = {}
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
                        stat = entry.stat()
                    except OSError:
                        continue
                    files[prefix + entry.name] = (stat.st_size, stat.st_mtime_ns)
                    if len(files) > MAX_FILES:
                        return None
        return FolderState(root, files)

    def changed(self) -> list[str]:
        """The files the first run changed (their size or modification time differ now)."""
        found = []
        for name, (size, mtime) in self.files.items():
            try:
                stat = os.stat(os.path.join(self.root, name))
            except OSError:
                continue
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
                found.append(name)
        return sorted(found)


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
    size = sum(s for s, _ in state.files.values())
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
