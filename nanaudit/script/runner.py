"""`nanaudit run` from start to report: the first run under the auditor's hooks, stopped at the
first non-finite value before the update; then, for a loss, gradient or error trip, the re-run
that names the op; then the early warnings read off the first run's timeline. It fills the
command's Report and raises on failure (the command's error shell turns that into the report's
error); it never prints or exits."""

from __future__ import annotations

import os
import time

from nanaudit.errors import NothingAuditedError, UserCodeError
from nanaudit.report.model import Finding, Report
from nanaudit.report.sections import FirstRun, ScriptRun
from nanaudit.report.vocabulary import Check, Status
from nanaudit.run.timeline import report_timeline
from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.findings import first_run_finding, link_warnings
from nanaudit.script.processes import ChildAudits, adopt
from nanaudit.script.scratch import FolderState
from nanaudit.script.target import (
    Ended,
    ScriptOptions,
    ScriptTarget,
    check_target,
    execute,
)
from nanaudit.script.trip import ScriptTrip


def audit_script(target: ScriptTarget, options: ScriptOptions, report: Report,
                 auditor: ScriptAuditor) -> UserCodeError | None:
    """Fill `report` from the first run (and the re-run). Returns the script's own exception
    when it raised because of the non-finite value the finding names (its frames stay in the
    report); the script raising for another reason is raised, as its UserCodeError."""
    started = time.perf_counter()
    check_target(target)
    # The folder before the first run: the re-run, if one is needed, runs in a copy of it.
    before = (FolderState.take(os.getcwd())
              if options.rerun and options.no_rerun_because is None else None)
    script_error, ended = None, Ended()
    try:
        with ChildAudits(target, options) as children:
            ended = execute(target, auditor, options.seed, children)
    except UserCodeError as error:
        # A script that raised because of a non-finite value (BCELoss refusing a NaN, a
        # weight an update made NaN): the value is the finding, the exception its effect.
        if auditor.after_error(error.exception) is None:
            raise
        script_error = error
    if auditor.trip is None:
        auditor.hooks.hear_skipped_loss()   # the script's last forward skipped its backward
        auditor.finish()
    record(report, auditor)
    assert report.run is not None
    report.run.first_run = FirstRun(steps=auditor.timeline.steps,
                                    duration_s=round(time.perf_counter() - started, 3),
                                    host_reads=auditor.host_reads, skipped=auditor.skipped)
    trip, keep = auditor.trip, auditor.keep
    if trip is None and (keep is None or not keep.log.count):
        if auditor.step == 0 and ended.children:
            # it trained in processes it started (processes.py): theirs is the account
            adopt(report, ended.children[0], children.started, len(ended.children))
            return None
        if auditor.step == 0:
            did = (f"after calling backward {auditor.ledger.backwards} time(s) but never stepping "
                   f"the optimizer it built, nor clearing the gradients with `zero_grad()` "
                   f"between backward calls" if auditor.ledger.backwards else
                   "without stepping an optimizer or calling backward")
            forked = (f"; it forked {ended.forks} process(es), and training in a forked "
                      f"process is not audited: train in the main process, or start the process "
                      f"with `multiprocessing`, or check the child's loop with "
                      f"`nanaudit.Sentinel`" if ended.forks else "")
            raise NothingAuditedError(
                f"the script `{target.display}` finished {did}: nanaudit checks at each "
                f"`optimizer.step()` (at each backward in a script that builds no optimizer, or "
                f"updates by hand and clears its gradients), so nothing was audited (does it "
                f"train? are its arguments right?){forked}")
        attach_timeline_warnings(report, None, auditor)
        report.status = Status.CLEAN
        return None
    report.status = Status.NONFINITE
    if trip is not None:
        finding = _localize_stop(target, options, report, auditor, trip, before)
        if keep is not None:
            if auditor.optimizer_count == 1:    # linked before the log keys it by its cause
                link_warnings(finding, auditor.warnings_so_far(trip.step),
                              _replay_precision(report), trip.optimizer, auditor.ledger.clips)
            keep.ended(finding, trip, auditor.hooks.tap.record)
    record(report, auditor)      # under --keep-going: every bad step's finding
    attach_timeline_warnings(report, trip, auditor)
    return script_error


def _localize_stop(target: ScriptTarget, options: ScriptOptions, report: Report,
                   auditor: ScriptAuditor, trip: ScriptTrip,
                   before: FolderState | None) -> Finding:
    """The finding of the step the run stopped at, in `report.finding` (and returned)."""
    # The localizers, imported at a trip only: a clean run's start-up does not pay for them.
    from nanaudit.script.before_window import traces_before
    from nanaudit.script.error_ranks import not_rerun_note
    from nanaudit.script.error_replay import localize_error
    from nanaudit.script.inprocess import adopt, localize_in_process
    from nanaudit.script.rerun import localize_by_rerun
    from nanaudit.script.update_replay import localize_update
    assert report.run is not None
    trip.unreached = trip.check == Check.LOSS and auditor.hooks.tap.record.skipped
    report.finding = first_run_finding(trip)
    if trip.needs_rerun:
        # At the trip, in this process (its cost one step's); the re-run from the start where
        # that cannot name the op (inprocess.py says why).
        localize = localize_error if trip.check == Check.ERROR else localize_in_process
        report.run.replay, localized = localize(auditor, options, trip, auditor.timeline)
        trip.made_before = traces_before(report.run.replay, options, trip, auditor.ranks,
                                         bool(auditor.hooks.tap.record.calls))
        if localized is not None:
            report.finding = adopt(localized, trip)
        elif trip.check == Check.ERROR and auditor.ranks is not None:
            # torchrun: the peers wait in a collective this rank never joins (error_ranks.py).
            replay = report.run.replay
            report.finding.explain(not_rerun_note(replay.note if replay else None))
        elif auditor.keep is not None and auditor.keep.log.skipped:
            report.finding.explain("not re-run: the run skipped bad steps before this one, and "
                                   "a re-run from the start would apply their updates")
        else:
            report.run.rerun, report.finding = localize_by_rerun(
                target, options, trip, auditor.timeline, report.finding, before)
    elif trip.check == Check.OPTIMIZER and options.rerun:
        # The update's inputs are gone; its rule is evaluated from the state it left.
        report.run.replay = localize_update(auditor, trip, report.finding)
    assert report.finding is not None
    if report.finding.element is None:      # a sharded tensor's bad element, by global index
        report.finding.element = trip.element
    return report.finding


def record(report: Report, auditor: ScriptAuditor) -> None:
    """What the first run saw so far, also when it was stopped or failed; nothing once the
    report is a child process's account (processes.py: this process's auditor saw no step)."""
    if report.run is not None and report.run.process is not None:
        return
    report.timeline, report.timeline_summary = report_timeline(auditor.timeline)
    report.steps_run = auditor.timeline.steps
    report.device = auditor.device or report.device
    if report.run is None:
        report.run = ScriptRun()
    if auditor.rank is not None:
        report.run.rank = auditor.rank
    if auditor.keep is not None:
        auditor.keep.log.apply(report)      # nothing until a bad step


def attach_timeline_warnings(report: Report, trip: ScriptTrip | None,
                             auditor: ScriptAuditor) -> None:
    """The warnings of a one-optimizer run (several optimizers' steps interleave on one
    timeline), linked to the finding as `scan` links them: growth before an overflow in float32
    makes it divergence, which names the weights, not particular samples."""
    if auditor.optimizer_count != 1:
        return
    report.warnings = auditor.early_warnings()
    finding = report.finding
    if finding is None or trip is None:
        return
    link_warnings(finding, report.warnings, _replay_precision(report), trip.optimizer,
                  auditor.ledger.clips)


def _replay_precision(report: Report) -> str:
    """The creating op's precision, from the replay or re-run (an fp32 input cast to float16 by
    autocast overflows float16's range, not by divergence); unknown without one: no cause is
    changed."""
    run = report.run
    named_by = [r for r in (run.replay, run.rerun) if r is not None] if run is not None else []
    return next((r.precision for r in named_by if r.precision), None) or "unknown"
