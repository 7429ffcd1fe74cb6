"""The scan pipeline: config -> session -> steps -> finding -> Report. Never prints or exits.

Expected failures (a bad config, the user's code raising, no data) come back as a Report with
status "error" and the error's exit code, so every caller renders and exits the same way.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nanaudit import __version__
from nanaudit.config import Config, load_config
from nanaudit.errors import FindingInterrupted, NanauditError, NothingAuditedError, UsageError
from nanaudit.exitcodes import ExitCode
from nanaudit.report import Report


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


def exit_code(report: Report) -> ExitCode:
    if report.status == "clean":
        if report.warnings and report.config.get("fail_on") == "warning":
            return ExitCode.WARNING
        return ExitCode.CLEAN
    if report.status == "nonfinite":
        return ExitCode.NONFINITE
    if report.status == "interrupted":
        return ExitCode((report.error or {}).get("exit_code", ExitCode.INTERRUPTED))
    return ExitCode((report.error or {}).get("exit_code", ExitCode.INTERNAL))


def mark_interrupted(report: Report, signal_name: str) -> None:
    """A run stopped by SIGINT or SIGTERM: the report keeps what it has, marked partial."""
    import signal
    report.status = "interrupted"
    code = ExitCode.TERMINATED if signal_name == signal.SIGTERM.name else ExitCode.INTERRUPTED
    report.error = {"type": "Interrupted", "signal": signal_name, "exit_code": int(code),
                    "message": f"stopped by {signal_name} after {report.steps_run} step(s); "
                               f"this report is partial"}


def _base_report(config_path, config: Config | None) -> Report:
    import torch
    return Report(tool_version=__version__, config=config.summary() if config else
                  {"path": str(config_path)}, torch_version=torch.__version__, device="",
                  status="error", steps_run=0)


BUG_REPORT = ("this is a bug in nanaudit, not in your code; please report it with this "
              "message, the full traceback (`error.traceback` in the --json report) and the "
              "output of `nanaudit --version` and `python -c 'import torch; "
              "print(torch.__version__)'`")


def error_dict(exc: BaseException) -> dict:
    if isinstance(exc, NanauditError):
        body = exc.to_dict()
        body["exit_code"] = int(exc.exit_code)
        return body
    first = (str(exc).strip().splitlines() or [""])[0][:500]   # torch's can run 300 lines
    return {"type": "InternalError", "message": f"{type(exc).__name__}: {first}",
            "exit_code": int(ExitCode.INTERNAL), "hint": BUG_REPORT,
            "traceback": traceback.format_exc()}


def _guarded(report: Report, body: Callable[[], None],
             on_error: Callable[[BaseException], None] | None = None) -> Report:
    """Run a command's body: every failure becomes the report's error, Ctrl-C a partial
    report, and the duration is recorded either way."""
    started = time.perf_counter()
    try:
        body()
    except KeyboardInterrupt:
        report.status = "interrupted"
    except Exception as exc:  # noqa: BLE001 - every failure becomes a report, never a traceback
        report.status = "error"
        report.error = error_dict(exc)
        if on_error is not None:
            on_error(exc)
    report.duration_s = time.perf_counter() - started
    return report


def scan(config_path: str | Path, options: ScanOptions = ScanOptions(),
         config: Config | None = None) -> Report:
    report = _base_report(config_path, config)
    coordinator = None

    def body():
        nonlocal coordinator
        loaded = config or _configured(config_path, options)
        report.config = loaded.summary()
        coordinator = _join(loaded)
        _run(loaded, options, report, coordinator)

    def on_error(exc):
        if coordinator is not None:
            _rank_failed(coordinator, exc, report)
    _guarded(report, body, on_error)
    if coordinator is not None:
        report.extra["distributed"] = {**coordinator.describe(),
                                       **report.extra.get("distributed", {})}
    return report


def _join(config: Config):
    """The torchrun coordinator when launched with WORLD_SIZE > 1, else None."""
    from nanaudit.distributed import Coordinator, launched_by_torchrun
    return Coordinator.start(config, config.device) if launched_by_torchrun() else None


def _rank_failed(coordinator, exc: BaseException, report: Report) -> None:
    """Under torchrun: adopt the error of the peer that failed first, or announce our own."""
    from nanaudit.distributed import DistributedError, is_collective_failure
    peer = coordinator.peer_error(wait_s=0.5)
    if peer is not None and peer.get("rank") != coordinator.rank:
        report.error = peer
        return
    if is_collective_failure(exc):
        # Nobody left an error: a peer died without one, or stopped answering.
        report.error = error_dict(DistributedError(
            f"rank {coordinator.rank}: a peer rank closed its connection or did not answer "
            f"within distributed.timeout_s ({coordinator.options.timeout_s:g}s): {exc}"))
    report.error["rank"] = coordinator.rank
    coordinator.fail(report.error)


def _configured(config_path, options: ScanOptions) -> Config:
    """The config with the command-line overrides, each validated like the key it replaces."""
    return load_config(config_path, {"steps": options.steps, "device": options.device,
                                     "seed": options.seed, "fail_on": options.fail_on})


def _run(config: Config, options: ScanOptions, report: Report, coordinator=None) -> None:
    from nanaudit.findings import attach_warnings, build_finding
    from nanaudit.loader import build_session, user_import_path
    from nanaudit.runner import ScanOutcome, run_steps
    with user_import_path(config.base_dir):
        session = build_session(config, coordinator)
        report.device = str(session.device)
        if options.on_start:
            options.on_start(config.steps)
        outcome = ScanOutcome()
        try:
            run_steps(session, config.steps, on_step=options.on_step, outcome=outcome)
        finally:
            # Kept when the user's code raises mid-run: the steps before it still count.
            report.steps_run = outcome.steps_run
            report.timeline = outcome.timeline
            report.warnings = outcome.warnings
            if outcome.read_mode is not None:
                report.extra["sentinel_read"] = outcome.read_mode.describe()
        if outcome.interrupted:
            report.status = "interrupted"
        elif outcome.trip is None:
            if outcome.steps_run == 0:
                raise NothingAuditedError(f"the data from `{config.data.target}` yielded no "
                                          f"batches: nothing was audited")
            report.status = "clean"
        else:
            report.status = "nonfinite"
            if _localizes_here(coordinator, outcome.trip):
                # Replays run on the local module: no DDP, no collectives with waiting peers.
                session.model = session.local_model
                samples = config.localize.samples if options.samples is None else options.samples
                try:
                    report.finding = build_finding(session, outcome, samples)
                except FindingInterrupted as stop:
                    report.finding = stop.finding   # the op is named; the sample search was cut
                    raise
                report.finding.rank = outcome.trip.rank
                attach_warnings(report.finding, outcome.warnings, session.precision.name)
                _write_repro(session, outcome, report, options)
        if coordinator is not None:
            _merge_ranks(coordinator, report)


def _write_repro(session, outcome, report: Report, options: ScanOptions) -> None:
    """The repro bundle of the finding, in a folder that holds nothing of the user's (see
    repro.bundle_folder); a failure is recorded for the CLI (exit 9 when --repro asked)."""
    if options.repro_dir is None or outcome.state is None:
        return
    from nanaudit.render import renderer_for
    from nanaudit.repro import bundle_folder, write_bundle
    folder = Path(options.repro_dir)
    if options.repro_per_step:
        rank = f"-rank{outcome.trip.rank}" if outcome.trip.rank is not None else ""
        folder = folder / f"repro-step{outcome.trip.step}{rank}"
    try:
        folder = bundle_folder(folder, outcome.trip.step)
        report.extra["repro"] = str(folder)
        write_bundle(folder, session, outcome.state, outcome.trip, report.finding,
                     renderer_for("json").render(report))
    except Exception as exc:  # noqa: BLE001 - the finding stands without its bundle
        report.extra["repro"] = None
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        report.extra["repro_error"] = f"cannot write the repro bundle to {folder}: {reason}"


def _localizes_here(coordinator, trip) -> bool:
    if coordinator is None:
        return True
    return coordinator.rank == (trip.rank if trip.rank is not None else 0)


def _merge_ranks(coordinator, report: Report) -> None:
    """Every rank learns every rank's status and the one finding (the others wait here while
    the finding's rank localizes, bounded by distributed.timeout_s)."""
    mine = {"rank": coordinator.rank, "status": report.status, "steps_run": report.steps_run,
            "device": report.device, "host": coordinator.describe()["host"],
            "warnings": len(report.warnings), "finding": report.finding,
            "repro": report.extra.get("repro")}
    ranks = coordinator.gather(mine)
    report.finding = next((r["finding"] for r in ranks if r["finding"] is not None), None)
    repro = next((r["repro"] for r in ranks if r["repro"]), None)
    if repro:
        # Written by the rank that localized, on its own host.
        report.extra["repro"] = repro
    report.extra["distributed"] = {"ranks": [
        {k: v for k, v in r.items() if k not in ("finding", "repro")} for r in ranks]}


def audit(config_or_path, **overrides) -> Report:
    """Library entry: a config path (or a loaded Config) plus ScanOptions fields as keywords."""
    options = ScanOptions(**overrides)
    if isinstance(config_or_path, Config):
        return scan(config_or_path.path, options, config=config_or_path)
    return scan(config_or_path, options)


def replay(folder: str | Path) -> Report:
    """`nanaudit replay DIR`: localize the step saved in a repro bundle again."""
    report = _base_report(Path(folder) / "config.yaml", None)
    report.command = "replay"
    return _guarded(report, lambda: _replay(Path(folder), report))


def _replay(folder: Path, report: Report) -> None:
    from nanaudit.findings import build_finding
    from nanaudit.loader import user_import_path
    from nanaudit.repro import load_bundle, replay_bundle
    bundle = load_bundle(folder)
    with user_import_path(Path(bundle.meta["base_dir"])):
        session, outcome = replay_bundle(bundle)
        report.config = session.config.summary()
        report.device = str(session.device)
        report.steps_run = 1
        report.finding = build_finding(session, outcome, session.config.localize.samples)
        report.finding.rank = outcome.trip.rank
    report.status = "clean" if report.finding.reproduced is False else "nonfinite"
    report.extra["repro"] = str(folder)


def bisect(config_path: str | Path, options: ScanOptions = ScanOptions(),
           checkpoints: Path | None = None, pattern: str | None = None) -> Report:
    """`nanaudit bisect`: every bad batch of the data set, or the first bad checkpoint."""
    report = _base_report(config_path, None)
    report.command = "bisect"

    def body():
        from nanaudit.distributed import launched_by_torchrun
        if launched_by_torchrun():
            raise UsageError("bisect runs in one process: run it without torchrun (it replays "
                             "batches one by one against fixed weights)")
        config = _configured(config_path, options)
        report.config = config.summary()
        if checkpoints is None:
            _bisect_data(config, options, report)
        else:
            _bisect_checkpoints(config, options, report, checkpoints, pattern)
    return _guarded(report, body)


def _bisect_data(config: Config, options: ScanOptions, report: Report) -> None:
    from nanaudit.bisect import bisect_data
    from nanaudit.loader import build_session, user_import_path
    with user_import_path(config.base_dir):
        session = build_session(config)
        report.device = str(session.device)
        if options.on_start:
            options.on_start(config.steps)
        result = bisect_data(session, config.steps, on_step=options.on_step)
    outcome = result["outcome"]
    report.steps_run, report.timeline = outcome.steps_run, outcome.timeline
    if outcome.steps_run == 0:
        raise NothingAuditedError(f"the data from `{config.data.target}` yielded no batches")
    findings = result["findings"]
    report.status = "interrupted" if outcome.interrupted else ("nonfinite" if findings else "clean")
    report.finding = findings[0] if findings else None
    report.extra["bisect"] = {"mode": "data", "batches_audited": outcome.steps_run,
                              "bad_batches": findings, "skip_list": result["skip_list"]}


def _bisect_checkpoints(config, options, report, folder, pattern) -> None:
    from nanaudit.bisect import bisect_checkpoints, linear_cost_note, list_checkpoints
    from nanaudit.findings import build_finding, state_finding
    from nanaudit.loader import build_session, user_import_path
    from nanaudit.runner import Trip
    files = list_checkpoints(Path(folder), pattern)
    with user_import_path(config.base_dir):
        session = build_session(config)
        report.device = str(session.device)
        result = bisect_checkpoints(session, files)
        outcome = result.pop("outcome")
        result["note"] = result.get("note") or linear_cost_note(result)
        report.extra["bisect"] = {"mode": "checkpoints", **result}
        if result["first_bad"] is None:
            report.status = "clean"
            return
        report.status = "nonfinite"
        if outcome is not None:
            report.steps_run, report.timeline = outcome.steps_run, outcome.timeline
        if outcome is not None and outcome.trip is not None:
            report.finding = build_finding(session, outcome, config.localize.samples)
        else:
            from nanaudit.loader import load_checkpoint, apply_model_state
            bad = result["first_bad"]
            apply_model_state(session.model, load_checkpoint(Path(bad["path"])), "--checkpoints",
                              bad["path"])
            report.finding = state_finding(session, Trip(bad["step"], "parameter"))
            report.finding.explanation += (
                f" ({bad['path']}; the replay from the last good checkpoint did not reach a "
                f"non-finite value" + ("" if result["optimizer_state"] else
                                       ": the checkpoint holds no optimizer state, so a fresh "
                                       "optimizer may not follow the original trajectory") + ")"
                if result["last_good"] else f" ({bad['path']}: the first checkpoint)")
