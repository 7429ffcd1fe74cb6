"""`python -m nanaudit` and the `nanaudit` console script.

The stop signals are noted from the very first line, before the command line's imports (click,
rich and the commands take a tenth of a second or more, torch far longer): a signal that arrives
meanwhile is kept in `EarlySignals.received`, and the command's own handler, once installed,
acts on it (cli/signals.py), so the run still leaves its partial report and exits 130 or 143
instead of dying with none."""

import os
import signal
import sys
import threading

from nanaudit.exitcodes import STOP_SIGNALS


class EarlySignals:
    """The handler of the stop signals until the command's own replaces it: it notes them
    (a second one exits at once, as the command's handler would)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signal.signal(signal.Signals[name], self)

    def __call__(self, signum: int, frame: object) -> None:
        if self.received:
            sys.stderr.write(f"\nnanaudit: second {signal.Signals(signum).name}, exiting now\n")
            os._exit(128 + signum)
        self.received.append(signum)


def main() -> None:
    EarlySignals().install()
    from nanaudit.cli import main as command_line
    command_line()


if __name__ == "__main__":
    main()
