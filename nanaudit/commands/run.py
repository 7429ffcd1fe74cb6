"""`nanaudit run`: audit an unmodified training script (the script stage does the work) inside
the error shell every command shares. Returns a Report; never prints or exits."""

from __future__ import annotations

import contextlib
import dataclasses

from nanaudit.commands.common import base_report, guarded, rank_failed
from nanaudit.errors import UserCodeError
from nanaudit.report.model import Report
from nanaudit.report.sections import UserCodeFailure
from nanaudit.run.distributed import Coordinator
from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.error_ranks import adopt_posted, post_and_leave
from nanaudit.script.inprocess import bad_step_finding
from nanaudit.script.keep_going import KeepGoing
from nanaudit.script.ranks import merge_ranks
from nanaudit.script.runner import audit_script, record
from nanaudit.script.target import ScriptOptions, ScriptTarget, script_rank


def summary(target: ScriptTarget, options: ScriptOptions) -> dict:
    """The report's `config` for a script run."""
    return {"path": target.display, "script": target.path, "module": target.module,
            "argv": list(target.args), "seed": options.seed, "rerun": options.rerun,
            "max_rerun_steps": options.max_rerun_steps, "fail_on": options.fail_on or "nonfinite"}


def run_script(target: ScriptTarget, options: ScriptOptions | None = None) -> Report:
    """The first run, then the re-run of a loss, gradient or error trip."""
    options = options or ScriptOptions()
    if options.audit_child is None:       # the processes the script starts: audited as it is
        options = dataclasses.replace(options, audit_child=run_script)
    report = base_report(target.display, None)
    report.config, report.command = summary(target, options), "run"
    auditor = ScriptAuditor(rank=script_rank())
    auditor.joins_late = target.call is not None    # a process the script started
    if options.keep_going:
        auditor.keep = KeepGoing(options.max_bad_steps,
                                 lambda trip: bad_step_finding(auditor, options, trip),
                                 lambda: auditor.step)

    def body() -> None:
        try:
            with auditor.keep.batches if auditor.keep else contextlib.nullcontext():
                script_error = audit_script(target, options, report, auditor)
        finally:
            record(report, auditor)
        if auditor.ranks is not None and script_error is not None:
            # torchrun: this rank raised while its peers wait in a collective it never joins:
            # its finding goes to them through the store, and it leaves alone.
            post_and_leave(auditor.ranks, report)
        elif auditor.ranks is not None:
            # torchrun: each rank's report names the rank that made the value, and every
            # rank's status.
            merge_ranks(auditor.ranks, report, auditor.trip.rank if auditor.trip else None)
        if script_error is not None:
            # The script's exception, raised because of the value the finding names: its frames
            # stay in the report; the finding's cause comes from the value.
            report.error = with_traceback(script_error)

    def on_error(exc: BaseException) -> None:
        if isinstance(exc, UserCodeError):
            report.error = with_traceback(exc)
        # torchrun: the ranks' group, also when it failed before the checks held it
        coord = auditor.ranks.coord if auditor.ranks is not None else Coordinator.adopt()
        if coord is not None and adopt_posted(coord, exc, report):
            return      # a peer raised on a non-finite value: its finding is this rank's
        if coord is not None:
            rank_failed(coord, exc, report, "in time")
            report.distributed = coord.describe()
    return guarded(report, body, on_error=on_error)


def with_traceback(error: UserCodeError) -> UserCodeFailure:
    """The script's error for the report, with its traceback as Python prints it."""
    info = error.to_error_info()
    info.traceback = error.formatted_traceback()
    return info
