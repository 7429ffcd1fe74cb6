"""SIGINT, SIGTERM and SIGHUP (as SIGTERM: a closed terminal) while a command runs.

The first signal stops the run at the next Python instruction and the partial report is
written (exit 130 or 143); one that arrives while the reports are being written lets them
finish, and the run's own result stands; a second signal exits at once (the files are written
atomically, so a report is the old one or the new one, never half of each).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from nanaudit.cli.outputs import Requested, final_code
from nanaudit.cli.process import exit_with, main_thread
from nanaudit.cli.streams import release_stdout
from nanaudit.cli.terminal import Terminal
from nanaudit.exitcodes import STOP_SIGNALS, stopped_by
from nanaudit.report.vocabulary import Status

if TYPE_CHECKING:
    from nanaudit.report.model import Report


class Stop:
    """SIGINT/SIGTERM/SIGHUP handling for one command (see the module docstring)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.holding = False
        self._previous: dict[int, Any] = {}
        self._early: int | None = None

    def __enter__(self) -> Stop:
        if main_thread():
            for name in STOP_SIGNALS:
                sig = signal.Signals[name]
                self._previous[sig] = signal.signal(sig, self._handle)
                # __main__'s EarlySignals noted what arrived while the command line imported.
                received = getattr(self._previous[sig], "received", None)
                if received and self._early is None:
                    self._early = received[0]
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None:
            from nanaudit.report.output import remove_temporaries
            remove_temporaries()        # os._exit runs no `finally`: no .tmp file left behind
            if sys.stderr is not None:
                sys.stderr.write(f"\nnanaudit: second {signal.Signals(signum).name}, "
                                 f"exiting now\n")
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        if not self.holding:
            raise KeyboardInterrupt(self.signal_name)

    def act_on_early_signal(self) -> None:
        """A stop signal that arrived before this handler was installed stops the run now."""
        if self._early is not None:
            self._handle(self._early, None)

    def hold(self) -> None:
        """From here on the first signal is noted, not raised: the reports are being written."""
        self.holding = True

    def note(self, report: Report) -> None:
        """A signal that arrived after the run's own handling (localizing, or at the very
        end) still marks the report partial: what the user stopped is not a clean result."""
        from nanaudit.commands.common import mark_interrupted
        if self.signal_name is not None and report.status != Status.ERROR:
            mark_interrupted(report, self.signal_name)


_STOPPABLE: set[str] = set()      # the commands whose Stop takes over __main__'s EarlySignals


def hand_over_early_signals(command: str | None) -> None:
    """Before a command that installs no Stop of its own (validate, init, --help): the stop
    signals get Python's default handling back, and one noted while importing ends the
    process now, as it would have."""
    if command in _STOPPABLE or not main_thread():
        return
    for name in STOP_SIGNALS:
        sig = signal.Signals[name]
        if getattr(signal.getsignal(sig), "received", None):
            exit_with(stopped_by(name))
        if hasattr(signal.getsignal(sig), "received"):
            signal.signal(sig, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)


def stoppable(command: str) -> Callable[[Callable], Callable]:
    """Cover a command from its first line: a signal that arrives before the run has a report
    (torch still importing, the outputs being checked) still leaves a partial report and exits
    130 or 143, not click's "Aborted!" with exit 1. The command gets the guard as `stop`: one
    handler for the whole command."""
    _STOPPABLE.add(command)

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def guarded_command(**kwargs: Any) -> Any:
            with Stop() as stop:
                try:
                    stop.act_on_early_signal()
                    return fn(**kwargs, stop=stop)
                except KeyboardInterrupt:
                    _stopped_early(stop, command, kwargs)
                finally:
                    release_stdout()
        return guarded_command
    return wrap


def _stopped_early(stop: Stop, command: str, options: dict[str, Any]) -> None:
    from nanaudit.commands.common import early_report
    stop.hold()
    # No plot: nothing ran to draw, and importing matplotlib would only delay the exit.
    outputs = Requested.from_options(options).without("plot")
    terminal = Terminal(bool(options.get("quiet")) or outputs.quiets_console)
    target = options.get("config") or options.get("bundle") or " ".join(
        options.get("script_args") or ())
    report = early_report(target, command, stop.signal_name or "SIGINT")
    failed = outputs.emit(report, terminal)
    exit_with(final_code(report, failed, terminal))


def finish_despite_sigterm() -> None:
    """Under torchrun, which stops the other ranks with SIGTERM once one exits: let this
    rank finish writing its reports."""
    if main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
