"""`nanaudit replay DIR`: localize again the step a repro bundle saved (written by `scan`, or by
`Sentinel` and the training callbacks; `--model` / `--loss` supply what the latter could not
record).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from nanaudit.commands.bundle_trust import EntrypointGate
from nanaudit.commands.common import base_report, guarded
from nanaudit.config.entrypoints import import_gate
from nanaudit.errors import UserCodeError
from nanaudit.report.model import Report
from nanaudit.report.vocabulary import Status


def replay(folder: str | Path, model: str | None = None, loss: str | None = None,
           trust: bool = False) -> Report:
    """`nanaudit replay DIR`: localize the step saved in a repro bundle again; without `trust`,
    only code from the bundle, the working folder and installed packages is imported (and
    what `model` / `loss` name: bundle_trust.py)."""
    report = base_report(Path(folder) / "config.yaml", None)
    report.command = "replay"
    return guarded(report, lambda: _replay(Path(folder), report, model, loss, trust))


def _replay(folder: Path, report: Report, model: str | None, loss: str | None,
            trust: bool) -> None:
    from nanaudit.commands.bundle import load_bundle
    from nanaudit.commands.bundle_session import bundle_import_path, replay_bundle
    from nanaudit.localize.findings import build_finding
    bundle = load_bundle(folder)
    gate = contextlib.nullcontext() if trust else import_gate(
        EntrypointGate(bundle, typed=(model, loss)))
    if not bundle.from_scan:
        report.config = {"path": str(folder), "source": bundle.source,
                         "model": model, "loss": loss}
    with gate, bundle_import_path(bundle, with_cwd=bool(model or loss)):
        session, outcome, notes = replay_bundle(bundle, model, loss)
        if bundle.from_scan:
            report.config = session.config.summary()
        report.device = str(session.device)
        report.steps_run = 1
        try:
            finding = build_finding(session, outcome, session.options.localize.samples)
        except UserCodeError as error:
            if notes:       # the user's code may have failed on a batch type kept plain
                error.what += f" (note: {'; '.join(notes)})"
            raise
    finding.rank = outcome.trip.rank
    if notes:
        finding.explain(f"replay note: {'; '.join(notes)}")
    report.finding = finding
    report.status = Status.CLEAN if finding.reproduced is False else Status.NONFINITE
    report.repro = str(folder)
