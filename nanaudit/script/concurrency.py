"""The script's other threads and the processes it forks, while `nanaudit run` audits it.

A check that stops the script (StepHalted) can fire in a thread the script started to train
in. That thread then ends quietly (threading's hook would print our internal stop as a
traceback), and the main thread is stopped too, at its next Python instruction, so the script
ends at the bad step as a single-threaded one does, instead of going on without it.

A process the script forks (`os.fork`, multiprocessing's fork start method, a DataLoader's
workers) inherits this one's hooks and signal handling. In the child both are undone at once:
it runs as plain Python, its signals are its own (a worker stopped with SIGTERM is not the run
being stopped), and its training, if it trains, is not audited; the forks are counted so a run
that audited nothing can say why.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

from nanaudit.run.intercept import StepHalted

_ACTIVE: list[ScriptThreads] = []


class ScriptThreads:
    """For the duration of one script run (a context manager): `undo_in_child` runs in each
    forked child; `forks` counts the children."""

    def __init__(self, undo_in_child: list[Callable[[], None]]):
        self.undo_in_child = undo_in_child
        self.forks = 0
        self._previous: Any = None

    def __enter__(self) -> ScriptThreads:
        self._previous = threading.excepthook
        threading.excepthook = self._thread_ended
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _thread_ended(self, args: Any) -> None:
        if args.exc_type is None or not issubclass(args.exc_type, StepHalted):
            self._previous(args)
        elif self in _ACTIVE and args.thread is not threading.main_thread():
            _stop_main_thread()


def _stop_main_thread() -> None:
    """StepHalted in the main thread, at its next Python instruction (it is most often
    joining the thread that stopped)."""
    ident = threading.main_thread().ident
    if ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                   ctypes.py_object(StepHalted))


def _after_fork_in_child() -> None:
    for run in list(_ACTIVE):
        for undo in run.undo_in_child:
            undo()
    _ACTIVE.clear()


def _after_fork_in_parent() -> None:
    for run in _ACTIVE:
        run.forks += 1


if hasattr(os, "register_at_fork"):      # POSIX: registered once, for the process's life
    os.register_at_fork(after_in_child=_after_fork_in_child,
                        after_in_parent=_after_fork_in_parent)
