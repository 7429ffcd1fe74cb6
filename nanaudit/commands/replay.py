"""`nanaudit replay DIR`: localize again the step a repro bundle saved.
"""

from __future__ import annotations

from pathlib import Path

from nanaudit.commands.common import base_report, guarded
from nanaudit.report.model import Report, Status


def replay(folder: str | Path) -> Report:
    """`nanaudit replay DIR`: localize the step saved in a repro bundle again."""
    report = base_report(Path(folder) / "config.yaml", None)
    report.command = "replay"
    return guarded(report, lambda: _replay(Path(folder), report))


def _replay(folder: Path, report: Report) -> None:
    from nanaudit.commands.repro import load_bundle, replay_bundle
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.localize.findings import build_finding
    bundle = load_bundle(folder)
    with user_import_path(Path(bundle.meta["base_dir"])):
        session, outcome = replay_bundle(bundle)
        report.config = session.config.summary()
        report.device = str(session.device)
        report.steps_run = 1
        report.finding = build_finding(session, outcome, session.config.localize.samples)
        report.finding.rank = outcome.trip.rank
    report.status = Status.CLEAN if report.finding.reproduced is False else Status.NONFINITE
    report.repro = str(folder)
