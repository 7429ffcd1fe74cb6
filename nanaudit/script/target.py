"""What `nanaudit run` runs and how: the script (a path or `-m module`) executed as `__main__`,
with the argv, `sys.path[0]` and `__file__` that `python` would give it, under the auditor's
hooks; the script's exceptions become the user's error with its own frames.

Ctrl-C, SIGTERM and SIGHUP during the script raise KeyboardInterrupt (so the partial report is
written) and are remembered: a framework that catches it and returns normally (Lightning's
graceful shutdown) still ends as interrupted.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nanaudit.errors import (
    USER_FAILURES,
    ConfigError,
    NanauditError,
    UserCodeError,
    delegates,
    own_error_within,
    raised_by_nanaudit,
)
from nanaudit.exitcodes import STOP_SIGNALS
from nanaudit.report.bad_steps import MAX_BAD_STEPS
from nanaudit.run.intercept import StepHalted
from nanaudit.run.seeding import seed_everything
from nanaudit.script.concurrency import ScriptThreads

_RUNPY = os.path.abspath(runpy.__file__)


@dataclass(frozen=True)
class ScriptTarget:
    """What to run: a script path or a module (`-m`), and the script's own arguments; `call`:
    in a process the script started, that process's own run instead (processes.py)."""

    path: str | None = None
    module: str | None = None
    args: tuple = ()
    call: Callable[[], None] | None = None

    @property
    def display(self) -> str:
        return f"-m {self.module}" if self.module else str(self.path)


@dataclass(frozen=True)
class ScriptOptions:
    """How `nanaudit run` audits: the seed set before the script, and the re-run's limits."""

    seed: int = 0
    rerun: bool = True
    force_rerun: bool = False             # --rerun: localize by the re-run, not in-process
    max_rerun_steps: int | None = None     # do not re-run past this many steps
    fail_on: str | None = None
    rerun_timeout_s: float | None = None
    on_rerun: Callable[[int], None] | None = None   # told the step the re-run goes to
    keep_going: bool = False          # skip a bad step's update and go on (--keep-going) ...
    max_bad_steps: int = MAX_BAD_STEPS   # ... at most this many; the next one stops the run
    skip_model: bool = True           # an input trip's re-run tries without the model first
    no_rerun_because: str | None = None   # why no re-run can be made here (a child process)
    # How a process the script starts is audited (commands/run.run_script; processes.py);
    # None: not audited (the re-run's processes)
    audit_child: Callable[..., Any] | None = None


class Hooks(Protocol):
    """What `execute` installs around the script (the auditor's global hooks)."""

    def install(self) -> Any: ...

    def remove(self) -> None: ...


def script_rank() -> int | None:
    """This process's rank under torchrun (None for a single process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0"))
    return None


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP as KeyboardInterrupt while the script runs, remembered (see
    the module docstring); the handlers in place before are restored on exit.

    A script may install its own handler (Lightning and the Trainer do, for SIGTERM) and return
    normally once it ran: the signal still stopped the run early. Python's wakeup fd hears
    every signal a Python handler takes, whoever's handler it is, so such a stop is still
    reported as interrupted (143), never as a clean run of the steps taken before it."""

    def __init__(self, halting: Callable[[], bool] | None = None) -> None:
        # `halting`: whether a SIGINT is a process the script started stopping the run at its
        # trip (processes.py), not the user's Ctrl-C
        self.halting = halting
        self._halts = 0
        self.seen = False
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._wakeup = -1
        self._heard: list[int] = []           # stop signals heard through the wakeup fd
        self._previous_handlers: dict = {}    # the handlers restored on exit

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signum = signal.Signals[name]
                self._previous[signum] = signal.signal(signum, self._raise)
            read, write = os.pipe()
            for fd in (read, write):
                os.set_blocking(fd, False)
            self._pipe = (read, write)
            self._wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous_handlers, self._previous = self._previous, {}
        self._heard = self._drain()

    def _drain(self) -> list[int]:
        """The stop signals the wakeup fd heard, in order; the fd put back as it was."""
        if self._pipe is None:
            return []
        read, write = self._pipe
        self._pipe = None
        signal.set_wakeup_fd(self._wakeup)
        heard = b""
        try:
            while chunk := os.read(read, 4096):
                heard += chunk
        except BlockingIOError:
            pass
        finally:
            os.close(read)
            os.close(write)
        stops = {int(signal.Signals[name]) for name in STOP_SIGNALS}
        heard_stops = [signum for signum in heard if signum in stops]
        if self._halts and int(signal.SIGINT) in heard_stops:
            heard_stops.remove(int(signal.SIGINT))     # a child's stop, not the user's
        return heard_stops

    def _raise(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.halting is not None and self.halting() \
                and not self._halts:
            self._halts += 1
            raise StepHalted()
        self.seen = True
        # The command's own handler (the CLI's) learns of it too: it names the signal in the
        # report and makes a second one exit at once.
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt()

    def in_child(self) -> None:
        """In a process the script forked: its signals are its own again (default handling,
        and no byte into this process's wakeup fd)."""
        if self._pipe is not None and signal.set_wakeup_fd(-1) != self._pipe[1]:
            signal.set_wakeup_fd(self._wakeup)      # not ours after all: put it back
        for signum in self._previous:
            if signal.getsignal(signum) == self._raise:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                              else signal.SIG_DFL)

    def raise_if_stopped(self) -> None:
        """After the script: KeyboardInterrupt when a stop signal arrived, also one that the
        script's own handler took (the command's handler is told which)."""
        if self.seen:
            raise KeyboardInterrupt()
        if self._heard:
            signum = self._heard[0]
            previous = self._previous_handlers.get(signum)
            if callable(previous):
                previous(signum, None)
            raise KeyboardInterrupt()


@dataclass
class Ended:
    """How the script's run ended, past what it raised: the processes it forked, and the
    reports of the processes it started that trained (processes.py), those that tripped first."""

    forks: int = 0
    children: list = field(default_factory=list)      # [processes.ChildReport]


def execute(target: ScriptTarget, hooks: Hooks, seed: int, children: Any = None) -> Ended:
    """Run the script as `__main__` under `hooks`; StepHalted (a check stopped it, in any of
    its threads, or in a process it started) ends it quietly. The script's exceptions become
    UserCodeError with its frames (runpy's and ours removed). `children`: the processes it
    starts, audited (processes.ChildAudits, entered by the caller; their reports are read
    here, before it lets go of them). In such a process (`target.call`) its run is run so,
    with the process's own signals, argv and seeds."""
    if target.call is not None:
        return _audited(target, hooks, target.call)
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    interrupts = Interrupts(children.halting if children is not None else None).__enter__()

    @delegates
    def script() -> None:
        seed_everything(seed)
        if target.module:
            sys.argv = [target.module, *target.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(str(target.path))
            sys.argv = [str(target.path), *target.args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    try:
        ended = _audited(target, hooks, script, children, undo_in_child=[interrupts.in_child])
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        _return_to(saved_cwd)
        interrupts.__exit__()
    interrupts.raise_if_stopped()
    return ended


def _audited(target: ScriptTarget, hooks: Hooks, run: Callable[[], None], children: Any = None,
             undo_in_child: list[Callable[[], None]] | None = None) -> Ended:
    """`run()` under `hooks`, as `execute` says. A child that stopped at a trip makes the
    script's own failure to go on (`mp.spawn`'s join raising on its exit) the stop; once the
    script ended or stopped, the processes it left running are waited for, as Python's exit
    would after the report (processes.ChildAudits.settle)."""
    tripped = children.tripped if children is not None else lambda: False
    hooks.install()
    threads = ScriptThreads(undo_in_child=[hooks.remove, *(undo_in_child or [])]).__enter__()
    try:
        run()
    except StepHalted:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0) and not tripped():
            raise user_error(target, exc, f"exited with status {exc.code}") from None
    except (KeyboardInterrupt, NanauditError):
        raise
    except USER_FAILURES as exc:
        if raised_by_nanaudit(exc):
            raise       # a hook of ours failed inside the script's call: a bug to report (exit 6)
        if not tripped():
            raise (own_error_within(exc) or user_error(target, exc)) from exc
    finally:
        threads.__exit__()
        hooks.remove()
    if children is None:
        return Ended(threads.forks)
    children.settle()
    return Ended(threads.forks, children.reports())


def _return_to(folder: str) -> None:
    """Back to the folder the script started in (it may `os.chdir`): the re-run starts there."""
    try:
        os.chdir(folder)
    except OSError:
        pass        # the script removed it: the outputs were resolved at start-up anyway


def user_error(target: ScriptTarget, exc: BaseException, note: str = "") -> UserCodeError:
    """The script's exception as the user's error, with the script's frames only."""
    error = UserCodeError(f"the script `{target.display}`" + (f" {note};" if note else ""), exc)
    error.frames = [f for f in error.frames if os.path.abspath(f.filename) != _RUNPY
                    and not f.filename.startswith("<frozen runpy")]
    return error


def check_target(target: ScriptTarget) -> None:
    """The script or module exists (a usage problem, before anything runs)."""
    if target.module:
        import importlib.util
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target.module) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigError(f"no module named `{target.module}` (from {os.getcwd()})")
    elif not Path(str(target.path)).is_file():
        raise ConfigError(f"no such script: {target.path}")


def rank_path(path: str | None, rank: int) -> str | None:
    """Where rank `rank` writes a report file given as PATH (stdout stays rank 0's)."""
    if not path or path == "-":
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))
