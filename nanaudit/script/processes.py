"""Training in the processes a script starts with `multiprocessing` (the ranks of
`torch.multiprocessing.spawn`, a hogwild trainer's `Process`es), audited as the script is.

`ChildAudits`, around the script in the parent, patches `BaseProcess._bootstrap`, so that each
process the script starts runs its target (`Process.run`) under an auditor of its own, as
`nanaudit run` runs a script (commands/run.py with `ScriptTarget.call`): a check at every step,
the trip localized in that process (no re-run: the script is the parent's), the ranks' exchange
once its processes join a group. A forked child inherits the patch; a spawned one (a new
interpreter), or one the forkserver forks, gets it from the preparation data its parent sends
for it, as coverage.py does: a stowaway whose unpickling patches the child before it imports
the script again as `__mp_main__`. DataLoader workers only load data (the run's own account of
their values is elsewhere) and a pool's workers run tasks for a parent waiting on each: neither
is audited. The private folder (mkdtemp: this user's alone) for the children's reports is made
when the script starts its first process that may train (a patched `BaseProcess.start`): a
script that starts none, or only workers, leaves none behind, even when it is killed.

A child that audited a step writes its report (its error too, when it raised) into the folder
(pickled, written atomically, read back only by the parent that made the folder). One that
tripped then exits with status 1, as a failed process does, and the first to trip stops the
parent too (`_tell_parent`), as a script stops at its bad step: `mp.spawn`'s join raising on
that exit is the stop, not the script's error. The parent's report, when it trained nothing
itself, is the first child's to trip, else that of the child that audited the most steps (its
error, when it raised); the report says which process."""

from __future__ import annotations

import functools
import multiprocessing.process
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanaudit.report.model import Report
from nanaudit.run.intercept import StepHalted

_Process: Any = multiprocessing.process.BaseProcess
_ORIGINAL_BOOTSTRAP = _Process._bootstrap
_ORIGINAL_START = _Process.start
_ORIGINAL_PREPARATION = multiprocessing.spawn.get_preparation_data
_KEY = "nanaudit_child_audits"       # the preparation data's entry (multiprocessing ignores it)


@dataclass(frozen=True)
class _Where:
    """What a child needs to audit its run: the folder for its report, the script's path, and
    the run's options that hold in a child (--keep-going and its limit, and `audit`: how a run
    is audited, commands/run.run_script, handed down: this stage does not import commands)."""

    folder: str
    script: str | None
    module: str | None
    keep_going: bool
    max_bad_steps: int
    audit: Callable[..., Report]
    parent: int                     # the pid of the run's own process, told of the first trip


_ACTIVE: _Where | None = None        # set in the parent once a child may train, inherited by a fork
_OPEN: ChildAudits | None = None     # the parent's audits around the script (ChildAudits.starting)


@dataclass(frozen=True)
class ChildReport:
    """A child's report, with which process it was and when it tripped (None: clean)."""

    report: Report
    process: str
    tripped_at: float | None


class ChildAudits:
    """Around one script run in the parent (a context manager): `reports()` once it ended."""

    def __init__(self, target: Any, options: Any) -> None:
        """`target`, `options`: the script's ScriptTarget and ScriptOptions; no audit (nothing
        patched) when `options` is None or has no `audit_child`, nor in a child itself (its
        own children's training is not audited: it has no stop of its own to give them)."""
        audit = options.audit_child if options is not None and target.call is None else None
        self._run = None if audit is None else (
            target.path, target.module, options.keep_going, options.max_bad_steps, audit)
        self._folder: str | None = None
        self.started = 0            # processes the script started that may train
        self._processes: list = []  # every process the script started (settle waits for them)

    def __enter__(self) -> ChildAudits:
        global _OPEN
        if self._run is None:
            return self
        _OPEN = self
        _Process._bootstrap, _Process.start = _bootstrap, _start
        multiprocessing.spawn.get_preparation_data = _preparation_data
        return self

    def starting(self, process: Any) -> None:
        """The script starts `process`: the folder, at the first that may train (a fork takes
        `_ACTIVE` as it is now, a spawned child its preparation data)."""
        global _ACTIVE
        if self._run is None:
            return
        self._processes.append(process)
        if _a_workers(process):
            return
        self.started += 1
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="nanaudit-children-")
            _ACTIVE = _Where(self._folder, *self._run, parent=os.getpid())

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE, _OPEN
        if self._run is None:
            return
        _ACTIVE, _OPEN = None, None
        _Process._bootstrap, _Process.start = _ORIGINAL_BOOTSTRAP, _ORIGINAL_START
        multiprocessing.spawn.get_preparation_data = _ORIGINAL_PREPARATION
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)     # ours: made in __enter__
            self._folder = None

    def reports(self) -> list[ChildReport]:
        """The children's reports so far: those that tripped first, in the order they did."""
        if self._folder is None:
            return []
        found = []
        for path in sorted(Path(self._folder).glob("*.report")):
            try:
                with path.open("rb") as f:
                    found.append(pickle.load(f))       # our own folder's, written by our child
            except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
                continue                               # a child killed while writing
        return sorted(found, key=lambda c: (c.tripped_at is None, c.tripped_at or 0.0,
                                            -c.report.steps_run))

    def tripped(self) -> bool:
        return any(c.tripped_at is not None for c in self.reports())

    def settle(self) -> None:
        """Wait for the non-daemon processes the script started and left running, as Python's
        exit would (after the report): what they audit is in it. A child's stop arriving
        meanwhile finds the script ended already. Only this run's own (a process an earlier
        run of this interpreter left in multiprocessing's list is not the script's), and each
        joined once: a process whose exit status someone else reaped (`os.waitpid(-1)`) stays
        "alive" to multiprocessing for ever, and joining it again spun at full CPU."""
        for child in self._processes:
            while not child.daemon and child.is_alive():
                try:
                    child.join()
                except StepHalted:
                    continue
                break

    def halting(self) -> bool:
        """A child that tripped told this process to stop (`_tell_parent`)."""
        return self._folder is not None and os.path.exists(os.path.join(self._folder, _HALT))


def adopt(report: Report, child: ChildReport, started: int, reported: int) -> None:
    """`report` (the parent's, which trained nothing) becomes the child's account; `started`:
    the processes the script started that may train, `reported`: those that audited a step and
    wrote their report (one that `mp.spawn`'s join terminated first wrote none)."""
    for name in ("status", "finding", "timeline", "timeline_summary", "warnings", "steps_run",
                 "device", "error", "run", "distributed", "findings", "bad_steps", "skip_list"):
        setattr(report, name, getattr(child.report, name))
    if report.run is not None:
        report.run.process = child.process
    if report.finding is not None:
        report.finding.explain(f"made in {child.process}; the script started {started} "
                               f"process(es) with multiprocessing, {reported} of which trained "
                               f"and reported")


def _preparation_data(name: str) -> dict:
    data = _ORIGINAL_PREPARATION(name)
    if _ACTIVE is not None:
        data[_KEY] = _Stowaway(_ACTIVE)
    return data


class _Stowaway:
    """Rides in a spawned child's preparation data; unpickled there, it patches the child."""

    def __init__(self, where: _Where) -> None:
        self.where = where

    def __reduce__(self) -> tuple:
        return _arrive, (self.where,)


def _arrive(where: _Where) -> None:
    """In a spawned child, before it imports the script again: its processes are audited."""
    global _ACTIVE
    _ACTIVE = where
    _Process._bootstrap = _bootstrap


def _start(self: Any) -> None:
    """`BaseProcess.start` in the parent: the children's folder made first, when needed."""
    if _OPEN is not None:
        _OPEN.starting(self)
    _ORIGINAL_START(self)


def _bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
    """`BaseProcess._bootstrap` in a child: its run audited (not a worker's, below); the
    processes it forks in turn are not (it has no stop of its own to give them)."""
    global _ACTIVE, _OPEN
    where, _ACTIVE, _OPEN = _ACTIVE, None, None
    if where is not None and not _a_workers(self):
        _audit_run(self, where)
    return _ORIGINAL_BOOTSTRAP(self, *args, **kwargs)


def _audit_run(process: Any, where: _Where) -> None:
    """The process's run audited. A rank of torch's `mp.spawn` runs `fn(i, *args)` inside
    `_wrap`, which turns the function's exception into exit status 1 (its traceback pickled for
    the parent), so the audit goes inside `_wrap`, around `fn`: a rank's error is then the
    audit's to analyse, before `_wrap` does what it does with it."""
    wrap = getattr(sys.modules.get("torch.multiprocessing.spawn"), "_wrap", None)
    if wrap is not None and process._target is wrap:
        fn, *rest = process._args
        process._args = (functools.partial(_audited_rank, fn, where, process), *rest)
        return
    run = process.run
    process.run = lambda: _audited(run, where, process)


def _audited_rank(fn: Callable[..., Any], where: _Where, process: Any, rank: int,
                  *args: Any) -> None:
    _audited(lambda: fn(rank, *args), where, process)


# The targets of workers that are not audited: a DataLoader's only load data, and a pool's run
# tasks for a parent waiting on each result: a trip that stopped a task would leave
# `Pool.map` waiting for ever (a ProcessPoolExecutor's worker would send the stop back).
_WORKERS = ("torch.utils.data", "multiprocessing.pool", "concurrent.futures")


def _a_workers(process: Any) -> bool:
    target = getattr(process, "_target", None)
    return getattr(target, "__module__", "").startswith(_WORKERS)


def _audited(run: Callable[[], Any], where: _Where, process: Any) -> None:
    """The process's run under its own auditor; its report to the parent when it audited a
    step; then what the run raised, raised again (the child ends as it would have), or, when a
    trip stopped it, status 1 (under --keep-going a run that went on ends as it would have)."""
    from nanaudit.script.target import ScriptOptions, ScriptTarget
    raised: list[tuple[BaseException, Any]] = []
    halted_at: list[float] = []

    def call() -> None:
        try:
            run()
        except StepHalted:
            halted_at.append(time.time())     # when it tripped: the parent's first is first
            raise
        except BaseException as exc:       # the child's own: raised again after the report,
            # raised again from the run's own frames: not the audit's, nor this one
            raised.append((exc, getattr(exc.__traceback__, "tb_next", None)))
            raise

    target = ScriptTarget(path=where.script, module=where.module, call=call)
    options = ScriptOptions(keep_going=where.keep_going, max_bad_steps=where.max_bad_steps,
                            audit_child=where.audit, no_rerun_because=(
        "not re-run: the value was made in a process the script started, whose run only the "
        "whole script repeats"))
    report = where.audit(target, options)
    if report.finding is not None or report.steps_run:
        tripped_at = (halted_at or [time.time()])[0] if report.finding is not None else None
        _write(where.folder, ChildReport(report, f"{process.name} (pid {os.getpid()})",
                                         tripped_at))
    if raised:
        exc, frames = raised[0]
        raise exc.with_traceback(frames)
    if halted_at:
        _tell_parent(where)
        raise SystemExit(1)


_HALT = "halt"


def _tell_parent(where: _Where) -> None:
    """The first child to trip stops the run's process with SIGINT, which its handler there
    turns into the stop (target.Interrupts): a parent blocked on this child's result (a
    queue's `get`, a join) would otherwise wait for ever. Once: the marker is made
    exclusively, so a second child's signal never reaches a run that is already reporting."""
    try:
        os.close(os.open(os.path.join(where.folder, _HALT), os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return                     # another child told it (or the run has ended)
    try:
        os.kill(where.parent, signal.SIGINT)
    except OSError:
        pass


def _write(folder: str, child: ChildReport) -> None:
    """Atomically: a parent reading the folder sees the whole report or none of it."""
    final = Path(folder) / f"{os.getpid()}.report"
    partial = final.with_suffix(".partial")
    try:
        with partial.open("wb") as f:
            pickle.dump(child, f)
        os.replace(partial, final)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        # the parent then says it audited nothing: the child's own run is not ours to fail
        partial.unlink(missing_ok=True)
