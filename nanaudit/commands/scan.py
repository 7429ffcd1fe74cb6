"""`nanaudit scan`: config -> session -> steps under sentinels -> finding -> Report (and the
repro bundle), with the rank coordination of a torchrun job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nanaudit.commands.common import (
    ScanOptions,
    base_report,
    configured,
    guarded,
    nothing_audited,
    rank_failed,
)
from nanaudit.config.schema import Config
from nanaudit.errors import FindingInterrupted, NothingAuditedError
from nanaudit.report.model import Finding, Report
from nanaudit.report.sections import RankStatus
from nanaudit.report.vocabulary import Check, Status


def scan(config_path: str | Path, options: ScanOptions | None = None,
         config: Config | None = None) -> Report:
    """`nanaudit scan CONFIG` (or a loaded `config`): the report of the run, every failure
    recorded in it."""
    chosen = options if options is not None else ScanOptions()
    report = base_report(config_path, config)
    coordinator = None

    def body() -> None:
        nonlocal coordinator
        loaded = config or configured(config_path, chosen)
        report.config = loaded.summary()
        coordinator = _join(loaded)
        _run(loaded, chosen, report, coordinator)

    def on_error(exc: Any) -> None:
        if coordinator is not None:
            rank_failed(coordinator, exc, report, f"within distributed.timeout_s "
                        f"({coordinator.options.timeout_s:g}s)")
    guarded(report, body, on_error)
    if coordinator is not None and report.distributed is None:
        report.distributed = coordinator.describe()     # the ranks did not get to meet
    return report


def _join(config: Config) -> Any:
    """The torchrun coordinator when launched with WORLD_SIZE > 1, else None."""
    from nanaudit.run.distributed import Coordinator, launched_by_torchrun
    return Coordinator.start(config, config.device) if launched_by_torchrun() else None


def _run(config: Config, options: ScanOptions, report: Report, coordinator: Any = None) -> None:
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.report.bad_steps import BadStepLog
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import build_session
    from nanaudit.run.step import ScanOutcome
    from nanaudit.run.timeline import report_timeline
    with user_import_path(config.base_dir):
        session = build_session(config, coordinator)
        report.device = str(session.device)
        if options.on_start:
            options.on_start(config.steps)
        outcome = ScanOutcome(bad_steps=BadStepLog(options.max_bad_steps)
                              if options.keep_going else None)
        samples = config.localize.samples if options.samples is None else options.samples

        def localize(tripped: ScanOutcome) -> Finding | None:
            # Keep-going traces every bad input at the end, in one read of the data.
            return _localize(session, tripped, samples, report, coordinator,
                             trace=tripped.bad_steps is None)
        recorder = None
        if outcome.bad_steps is not None:
            from nanaudit.commands.bad_steps import BadStepRecorder
            recorder = BadStepRecorder(outcome, localize, coordinator)
        try:
            run_steps(session, config.steps, on_step=options.on_step, outcome=outcome,
                      on_skip=recorder.on_skip if recorder is not None else None)
        finally:
            # Kept when the user's code raises mid-run: the steps before it still count.
            report.steps_run = outcome.steps_run
            report.timeline, report.timeline_summary = report_timeline(outcome.timeline)
            report.warnings = outcome.warnings
            read = outcome.read_mode
            if read is not None:
                report.sentinel_read = read.section(outcome.steps_run_again)
        if outcome.interrupted:
            report.status = Status.INTERRUPTED
        elif outcome.trip is None:
            if outcome.steps_run == 0:
                raise NothingAuditedError(nothing_audited(config))
            report.status = Status.CLEAN
        else:
            report.status = Status.NONFINITE
            report.finding = localize(outcome)
            if report.finding is not None and _localizes_here(coordinator, outcome.trip) and \
                    not (coordinator is not None and coordinator.sharded):
                with _on_local_model(session):
                    _write_repro(session, outcome, report, options)
        if recorder is not None:
            from nanaudit.localize.data_replay import trace_input_findings
            recorder.finish(report, report.finding if outcome.trip is not None else None,
                            lambda inputs: trace_input_findings(session, outcome, inputs))
        if coordinator is not None:
            _merge_ranks(coordinator, report, session.model)


def _localize(session: Any, outcome: Any, samples: bool, report: Report,
              coordinator: Any, trace: bool = True) -> Finding | None:
    """The finding of the outcome's trip: built by the rank the trip names (FSDP2: by every
    rank at once, its collectives need them all); None on the other ranks. `trace`: name what
    made a non-finite input now, in the data read again."""
    from nanaudit.localize.data_replay import trace_input
    from nanaudit.localize.early_warnings import attach_warnings
    from nanaudit.localize.findings import build_finding
    if coordinator is not None and coordinator.sharded:
        from nanaudit.localize.sharded_replay import rank_finding
        finding = rank_finding(coordinator, coordinator.pre_reduce, session, outcome,
                               partials=coordinator.parallel.partials)
    elif _localizes_here(coordinator, outcome.trip):
        try:
            with _on_local_model(session):
                finding = build_finding(session, outcome, samples)
                if trace and outcome.trip.check == Check.INPUT:
                    trace_input(session, outcome, finding)
        except FindingInterrupted as stop:
            report.finding = stop.finding   # the op is named; the sample search was cut
            raise
        finding.rank = outcome.trip.rank
    else:
        return None
    attach_warnings(finding, outcome.warnings, session.precision.name)
    return finding


@contextmanager
def _on_local_model(session: Any) -> Iterator[None]:
    """Replays run on the local module: no DDP, no collectives with waiting peers. The
    wrapper is put back after, for the steps a run that keeps going still takes."""
    model = session.model
    session.model = session.local_model
    try:
        yield
    finally:
        session.model = model


def _write_repro(session: Any, outcome: Any, report: Report, options: ScanOptions) -> None:
    """The repro bundle of the finding, in a folder that holds nothing of the user's (see
    bundle.bundle_folder); a failure is recorded for the CLI (exit 9 when --repro asked)."""
    if options.repro_dir is None or outcome.state is None:
        return
    from nanaudit.commands.bundle import bundle_folder, write_bundle
    from nanaudit.report.formats import renderer_for
    folder = Path(options.repro_dir)
    if options.repro_per_step:
        rank = f"-rank{outcome.trip.rank}" if outcome.trip.rank is not None else ""
        folder = folder / f"repro-step{outcome.trip.step}{rank}"
    try:
        folder = bundle_folder(folder, outcome.trip.step)
        report.repro = str(folder)
        write_bundle(folder, session, outcome.state, outcome.trip, report.finding,
                     renderer_for("json").render(report))
    except Exception as exc:
        report.repro = None
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        report.repro_error = f"cannot write the repro bundle to {folder}: {reason}"


def _localizes_here(coordinator: Any, trip: Any) -> bool:
    if coordinator is None:
        return True
    return coordinator.rank == (trip.rank if trip.rank is not None else 0)


def _merge_ranks(coordinator: Any, report: Report, model: Any) -> None:
    """Every rank learns every rank's status (with its mesh coordinate) and the one finding
    (the others wait here while the finding's rank localizes, bounded by
    distributed.timeout_s)."""
    from nanaudit.run.mesh import MeshView
    section, view = coordinator.describe(), MeshView.of(model)
    mine = RankStatus(rank=coordinator.rank, status=report.status, steps_run=report.steps_run,
                      device=report.device, host=section.host, warnings=len(report.warnings),
                      mesh=view.coordinate(coordinator.rank) if view else None)
    ranks = coordinator.gather((mine, report.finding, report.repro))
    report.finding = next((finding for _, finding, _ in ranks if finding is not None), None)
    repro = next((repro for _, _, repro in ranks if repro), None)
    if repro:
        # Written by the rank that localized, on its own host.
        report.repro = repro
    section.ranks = [status for status, _, _ in ranks]
    report.distributed = section


def audit(config_or_path: Any, **overrides: Any) -> Report:
    """Library entry: a config path (or a loaded Config) plus ScanOptions fields as keywords."""
    options = ScanOptions(**overrides)
    if isinstance(config_or_path, Config):
        return scan(config_or_path.path, options, config=config_or_path)
    return scan(config_or_path, options)
