"""The process's stdout and stderr as nanaudit writes to them, whatever state they are in.

stdout carries machine output only: while `--json -` writes the report there, everything else
that would reach it (the user's prints, a library's, a child process's) goes to stderr, because
file descriptor 1 itself is pointed at stderr and the report goes to a copy of the original kept
aside (`reserve_stdout`, undone by `release_stdout`). Machine output is written as UTF-8 bytes
(JSON and GitHub's runner read UTF-8), whatever PYTHONIOENCODING says. A stream that is closed
(`>&-`, `2>&-`) or broken (`| head`) raises OSError here, for the caller to report as a failed
output (exit 9), never a traceback.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import Any

STDERR = "<stderr>"
"""A destination meaning stderr (an absolute path never reads so): GitHub annotations while
stdout carries the JSON report."""

_reserved: dict[str, Any] = {}     # "stream": the original stdout; "fd": its descriptor's copy


def reserve_stdout() -> None:
    """From here on stdout is the machine output's alone (see the module docstring)."""
    if _reserved or sys.stdout is None:
        return
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        # Not a real file (a test runner's capture): swap the Python object instead.
        _reserved["stream"] = sys.stdout
        sys.stdout = sys.stderr if sys.stderr is not None else io.StringIO()
        return
    kept = os.dup(fd)
    try:
        os.dup2(_stderr_fd(), fd)
    except OSError:
        os.close(kept)
        return
    _reserved.update(stream=os.fdopen(kept, "wb", closefd=False), fd=kept)


def release_stdout() -> None:
    """stdout back as it was (the command is over)."""
    if not _reserved:
        return
    stream, kept = _reserved.pop("stream"), _reserved.pop("fd", None)
    if kept is None:
        sys.stdout = stream
        return
    try:
        if sys.stdout is not None:
            sys.stdout.flush()      # the user's prints, still bound for stderr
        stream.flush()
        os.dup2(kept, 1)
    except (OSError, ValueError):
        pass
    finally:
        os.close(kept)


def _stderr_fd() -> int:
    """stderr's descriptor, or /dev/null's when stderr is closed."""
    try:
        if sys.stderr is not None:
            return sys.stderr.fileno()
    except (OSError, ValueError):
        pass
    return os.open(os.devnull, os.O_WRONLY)


def stdout_is_free() -> bool:
    """stdout carries no machine output: a message may go there when stderr cannot take it."""
    return not _reserved


def write_stdout(data: bytes) -> None:
    _write(_reserved.get("stream", sys.stdout), data, "stdout")


def write_stderr(data: bytes) -> None:
    _write(sys.stderr, data, "stderr")


def _write(stream: Any, data: bytes, name: str) -> None:
    if stream is None:
        raise OSError(errno.EBADF, f"{name} is closed")
    try:
        binary = stream if isinstance(stream, io.BufferedIOBase) else getattr(stream, "buffer",
                                                                              None)
        if binary is None:
            stream.write(data.decode("utf-8"))
            stream.flush()
            return
        if binary is not stream:
            stream.flush()          # what was written as text goes first
        binary.write(data)
        binary.flush()
    except ValueError as exc:       # "I/O operation on closed file"
        raise OSError(errno.EBADF, f"{name} is closed") from exc


def settle_before_exit() -> None:
    """Flush both streams now; one that cannot be flushed is dropped, so the interpreter's own
    flush at exit cannot turn the exit code into 120 with a traceback."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            setattr(sys, name, None)
