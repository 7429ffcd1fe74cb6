"""How the process ends: the exit code of a report, `sys.exit` with it, and under torchrun the
ranks' early or joint exit without interpreter teardown.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from nanaudit.exitcodes import ExitCode

if TYPE_CHECKING:
    from nanaudit.report.model import Report


def exit_with(code: ExitCode) -> NoReturn:
    from nanaudit.cli.streams import settle_before_exit
    settle_before_exit()
    sys.exit(int(code))


def code_of(report: Report) -> ExitCode:
    from nanaudit.commands.common import exit_code
    return exit_code(report)


def is_rank_zero() -> bool:
    """Under torchrun only rank 0 prints and writes reports; the others only exit."""
    return os.environ.get("RANK", "0") == "0"


def main_thread() -> bool:
    """Signal handlers can only be set from the main thread (not, say, a test's worker)."""
    return threading.current_thread() is threading.main_thread()


def leave_early_if_failed(code: ExitCode) -> None:
    """Under torchrun, a rank other than 0 whose own code failed ends its process now: its
    closed connections are what frees the peers blocked in a collective with it."""
    from nanaudit.run.distributed import current
    coordinator = current()
    if coordinator is not None and coordinator.failed and coordinator.rank != 0:
        _exit_now(code)


def leave_process_group(code: ExitCode) -> None:
    """Under torchrun: meet the other ranks (after rank 0 wrote the report) and exit at once:
    the reports are written and flushed, and a slow interpreter teardown would let torchrun
    see one rank exit first and stop the others with SIGTERM."""
    from nanaudit.run.distributed import current
    coordinator = current()
    if coordinator is not None:
        coordinator.shutdown()
        _exit_now(code)


def _exit_now(code: ExitCode) -> NoReturn:
    """Flush and leave without interpreter teardown (torchrun ranks only)."""
    from nanaudit.cli.streams import settle_before_exit
    settle_before_exit()        # a closed stream (None, or failing to flush) is no traceback
    os._exit(int(code))
