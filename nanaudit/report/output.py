"""Write report files atomically and safely: never over a folder, never a half-written file.

A file is written to a temporary name in its own folder and renamed into place, so a reader
(a CI system collecting artifacts, a second signal) sees the old file or the new one, never a
mix. A path that is a symlink or not a regular file (a FIFO, /dev/stdout) is written through
instead: it is the user's, and replacing it would be modifying it. `tempfile` creates files 0600
and folders 0700; they are widened to what the umask allows, as `open()` and `mkdir` would have,
so artifacts uploaded by another user stay readable; a file rewritten keeps the mode it had
(a private 0600 report stays private, a 0444 one read-only). Text is UTF-8, a lone surrogate
(a file name os.listdir could not decode, in a user's message) written escaped, never a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(OSError):
    """A requested output cannot be written; the message names the path and the reason."""


_IN_FLIGHT: set[str] = set()     # temporary files and folders being written right now


@contextmanager
def in_flight(temporary: str | Path) -> Iterator[None]:
    """`temporary` is being written: remove_temporaries() removes it if the process must exit
    at once meanwhile."""
    _IN_FLIGHT.add(str(temporary))
    try:
        yield
    finally:
        _IN_FLIGHT.discard(str(temporary))


def remove_temporaries() -> None:
    """Remove every temporary still being written, for a process about to leave without
    running its `finally` clauses (a second signal: `os._exit`)."""
    for temporary in list(_IN_FLIGHT):
        if os.path.isdir(temporary) and not os.path.islink(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
        elif os.path.lexists(temporary):
            try:
                os.unlink(temporary)
            except OSError:
                pass


def current_umask() -> int:
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | Path, directory: bool = False) -> None:
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def encoded(text: str) -> bytes:
    return text.encode("utf-8", "backslashreplace")


def write_atomic(path: str | Path, text: str) -> None:
    write_atomic_bytes(path, encoded(text))


def write_atomic_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    problem = output_problem(path)
    if problem:
        raise OutputError(problem)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # A symlink, a FIFO, /dev/stdout: the user's own object, written through in place,
        # never replaced by a regular file (as root, replacing /dev/null would break the box).
        with open(path, "wb") as handle:
            handle.write(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with in_flight(tmp):
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            _keep_mode(path, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _keep_mode(path: Path, tmp: str) -> None:
    """The replacement gets the mode of the file it replaces, or the umask's for a new one."""
    try:
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    except FileNotFoundError:
        honour_umask(tmp)


def output_problem(path: str | Path, folder: bool = False) -> str | None:
    """Why `path` cannot receive a file (with `folder`, a folder's files: a repro bundle), or
    None: checked before a run, so a scan never spends its steps only to fail at the end."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        return f"{path} is a file; give a folder"
    if folder and path.is_dir():
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    if path.is_dir():
        return f"{path} is a folder; give a file name"
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        return f"{parent} is a file, so {path} cannot be created under it"
    if parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    if path.exists() and not os.access(path, os.W_OK) and not os.access(path.parent, os.W_OK):
        return f"{path} is not writable"
    return None
