"""What every command shares: the options, the guarded shell that turns every failure into
the report's error (Ctrl-C into a partial report), and the report's exit code. Commands return
a Report and never print or exit; expected failures (a bad config, the user's code raising, no
data) come back as a Report with status "error" and the error's exit code.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanaudit._version import __version__
from nanaudit.config.schema import Config
from nanaudit.errors import USER_FAILURES, NanauditError, UserCodeError
from nanaudit.exitcodes import ExitCode, stopped_by
from nanaudit.report.bad_steps import MAX_BAD_STEPS
from nanaudit.report.model import Report
from nanaudit.report.sections import ErrorInfo, InternalFailure, Interruption
from nanaudit.report.vocabulary import Status


@dataclass(frozen=True)
class ScanOptions:
    steps: int | None = None
    device: str | None = None
    seed: int | None = None
    samples: bool | None = None       # None: the config's localize.samples
    fail_on: str | None = None        # None: the config's fail_on
    repro_dir: Path | None = None     # write a repro bundle on a finding (None: don't)
    repro_per_step: bool = False      # ... into repro_dir/repro-step<N> rather than repro_dir
    on_step: Callable[[int], None] | None = None
    on_start: Callable[[int | None], None] | None = None   # told the number of steps, if known
    keep_going: bool = False          # skip a bad step's update and go on (--keep-going) ...
    max_bad_steps: int = MAX_BAD_STEPS   # ... at most this many; the next one stops the run


def exit_code(report: Report) -> ExitCode:
    if report.status == Status.CLEAN:
        if report.warnings and report.config.get("fail_on") == "warning":
            return ExitCode.WARNING
        return ExitCode.CLEAN
    if report.status == Status.NONFINITE:
        return ExitCode.NONFINITE
    if report.error is not None:
        return ExitCode(report.error.exit_code)
    return ExitCode.INTERRUPTED if report.status == Status.INTERRUPTED else ExitCode.INTERNAL


def early_report(target: Any, command: str, signal_name: str) -> Report:
    """The report of a command stopped before it built its own (torch still importing)."""
    import sys
    torch = sys.modules.get("torch")
    report = Report(tool_version=__version__, config={"path": str(target)},
                    torch_version=getattr(torch, "__version__", ""), device="",
                    status=Status.INTERRUPTED, steps_run=0, command=command)
    mark_interrupted(report, signal_name)
    return report


def mark_interrupted(report: Report, signal_name: str) -> None:
    """A run stopped by SIGINT or SIGTERM: the report keeps what it has, marked partial."""
    report.status = Status.INTERRUPTED
    code = stopped_by(signal_name)
    report.error = Interruption(signal=signal_name, exit_code=code,
                                message=f"stopped by {signal_name} after {report.steps_run} "
                                        f"step(s); this report is partial")


def base_report(config_path: Any, config: Config | None) -> Report:
    import torch
    return Report(tool_version=__version__, config=config.summary() if config else
                  {"path": str(config_path)}, torch_version=torch.__version__, device="",
                  status=Status.ERROR, steps_run=0)


BUG_REPORT = ("this is a bug in nanaudit, not in your code; please report it with this "
              "message, the full traceback (`error.traceback` in the --json report) and the "
              "output of `nanaudit --version` and `python -c 'import torch; "
              "print(torch.__version__)'`")


def error_info(exc: BaseException) -> ErrorInfo:
    """The report's `error` for a failure: ours as typed, anything else as a bug of ours."""
    if isinstance(exc, NanauditError):
        return exc.to_error_info()
    first = (str(exc).strip().splitlines() or [""])[0][:500]   # torch's can run 300 lines
    return InternalFailure(message=f"{type(exc).__name__}: {first}", hint=BUG_REPORT,
                           traceback=traceback.format_exc())


def guarded(report: Report, body: Callable[[], None],
             on_error: Callable[[BaseException], None] | None = None) -> Report:
    """Run a command's body: every failure becomes the report's error, Ctrl-C a partial
    report, and the duration is recorded either way."""
    started = time.perf_counter()
    try:
        body()
    except KeyboardInterrupt:
        report.status = Status.INTERRUPTED
    except USER_FAILURES as exc:
        if not isinstance(exc, Exception):
            # sys.exit or GeneratorExit that no narrower guard named: ours never raise them.
            exc = UserCodeError("the user's code", exc)
        report.status = Status.ERROR
        report.error = error_info(exc)
        if on_error is not None:
            on_error(exc)
    report.duration_s = time.perf_counter() - started
    return report


def configured(config_path: Any, options: ScanOptions) -> Config:
    """The config with the command-line overrides, each validated like the key it replaces;
    a file with problems raises them all, those of the code it names included."""
    from nanaudit.config.validate import load_with_all_problems
    return load_with_all_problems(config_path, {"steps": options.steps, "device": options.device,
                                     "seed": options.seed, "fail_on": options.fail_on})


def nothing_audited(config: Config) -> str:
    """Why a run audited no step: no batches, or fewer than one accumulation window."""
    if config.accumulate > 1:
        # The data may have batches, just fewer than one window, which is never applied.
        return (f"the data from `{config.data.target}` yielded fewer batches than one "
                f"accumulation window (`accumulate: {config.accumulate}`): a last window the "
                f"data cannot fill is not run, so nothing was audited; lower `accumulate` or "
                f"give more batches")
    return f"the data from `{config.data.target}` yielded no batches: nothing was audited"


def rank_failed(coordinator: Any, exc: BaseException, report: Report, patience: str) -> None:
    """Under torchrun: adopt the error of the peer that failed first, or announce our own (a
    collective that failed without one: a peer died, or stopped answering `patience`)."""
    from nanaudit.run.distributed import DistributedError, is_collective_failure
    peer = coordinator.peer_error(wait_s=0.5)
    if peer is not None and peer.rank != coordinator.rank:
        report.error = peer
        # The group failed: this rank leaves as the failed one did, never waiting at the
        # exit barrier for a peer that died (it would wait the barrier's whole bound).
        coordinator.failed = True
        return
    if is_collective_failure(exc):
        report.error = error_info(DistributedError(
            f"rank {coordinator.rank}: a peer rank closed its connection or did not answer "
            f"{patience}: {exc}"))
    assert report.error is not None, "guarded() records the error before on_error"
    report.error.rank = coordinator.rank
    coordinator.fail(report.error)
