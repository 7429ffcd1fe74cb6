"""The scan pipeline: config -> session -> steps -> finding -> Report. Never prints or exits.

Expected failures (a bad config, the user's code raising, no data) come back as a Report with
status "error" and the error's exit code, so every caller renders and exits the same way.
"""

from __future__ import annotations

from pathlib import Path

from nanaudit.commands.common import _base_report, _guarded
from nanaudit.report.model import Report


def replay(folder: str | Path) -> Report:
    """`nanaudit replay DIR`: localize the step saved in a repro bundle again."""
    report = _base_report(Path(folder) / "config.yaml", None)
    report.command = "replay"
    return _guarded(report, lambda: _replay(Path(folder), report))


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
    report.status = "clean" if report.finding.reproduced is False else "nonfinite"
    report.extra["repro"] = str(folder)
