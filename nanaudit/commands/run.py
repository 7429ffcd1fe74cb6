"""`nanaudit run`: audit an unmodified training script (the script stage does the work) inside
the error shell every command shares. Returns a Report; never prints or exits."""

from __future__ import annotations

from nanaudit._version import __version__
from nanaudit.commands.common import error_info, guarded
from nanaudit.errors import UserCodeError
from nanaudit.report.model import Report, Status
from nanaudit.script.runner import audit_script, new_auditor, record
from nanaudit.script.target import ScriptOptions, ScriptTarget


def summary(target: ScriptTarget, options: ScriptOptions) -> dict:
    """The report's `config` for a script run."""
    return {"path": target.display, "script": target.path, "module": target.module,
            "argv": list(target.args), "seed": options.seed, "rerun": options.rerun,
            "max_rerun_steps": options.max_rerun_steps, "fail_on": options.fail_on or "nonfinite"}


def run_script(target: ScriptTarget, options: ScriptOptions | None = None) -> Report:
    """The first run, then the re-run of a loss, gradient or error trip."""
    import torch
    options = options or ScriptOptions()
    report = Report(tool_version=__version__, config=summary(target, options),
                    torch_version=torch.__version__, device="", status=Status.ERROR, steps_run=0,
                    command="run")
    auditor = new_auditor()

    def body() -> None:
        try:
            script_error = audit_script(target, options, report, auditor)
        finally:
            record(report, auditor)
        if script_error is not None:
            # The script's exception, raised because of the value the finding names: its frames
            # stay in the report; the finding's cause comes from the value.
            report.error = error_info(script_error)
            report.error.traceback = script_error.formatted_traceback()

    def with_frames(exc: BaseException) -> None:
        if isinstance(exc, UserCodeError) and report.error is not None:
            report.error.traceback = exc.formatted_traceback()
    return guarded(report, body, on_error=with_frames)
