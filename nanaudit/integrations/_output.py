"""What an integration writes on a finding: the console, JSON and Markdown reports and the
step's data (weights, RNG state, batch, offending rows), into one folder."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

from nanaudit.report.model import Report
from nanaudit.report.output import write_atomic

REPORT_FILES = {"json": "nanaudit.json", "markdown": "nanaudit.md", "console": "nanaudit.txt"}


def console_text(report: Report, color: bool = False, width: int = 100) -> str:
    from rich.console import Console

    from nanaudit.report.console import print_report
    buffer = io.StringIO()
    print_report(report, Console(file=buffer, width=width, force_terminal=color,
                                 color_system="standard" if color else None))
    return buffer.getvalue()


def write_reports(report: Report, folder: str | Path, echo: bool = True) -> dict:
    """Write nanaudit.json, nanaudit.md and nanaudit.txt into `folder`; with `echo`, print the
    console report to stderr too. Returns {format: path}."""
    folder = Path(folder)
    from nanaudit.report.formats import renderer_for
    paths = {}
    for fmt, name in REPORT_FILES.items():
        text = console_text(report) if fmt == "console" else renderer_for(fmt).render(report)
        write_atomic(folder / name, text)
        paths[fmt] = str(folder / name)
    if echo:
        sys.stderr.write(console_text(report, color=sys.stderr.isatty()))
    return paths


def write_step_bundle(folder: str | Path, model: torch.nn.Module, optimizer, trip, state,
                      finding, report_json: str, meta: dict) -> Path:
    """The failing step's data, written atomically: state.pt (model and optimizer state before
    the update), rng.pt, batch.pt, rows.pt (the offending rows), meta.json, report.json.
    Everything loads with torch.load(weights_only=True)."""
    from nanaudit.commands.repro import bundle_folder, plain_rng, publish_bundle, to_plain_cpu
    # The same rules as `scan`'s bundles: never replace a folder nanaudit did not write.
    folder = bundle_folder(Path(folder), state.step)

    def fill(tmp: Path) -> None:
        optim_state = None
        if optimizer is not None and hasattr(optimizer, "state_dict"):
            optim_state = to_plain_cpu(optimizer.state_dict())
        torch.save({"model": to_plain_cpu(model.state_dict()), "optimizer": optim_state},
                   tmp / "state.pt")
        torch.save({"torch_cpu": state.rng.torch_cpu, "cuda": state.rng.cuda,
                    "python": plain_rng(state.rng.python)}, tmp / "rng.pt")
        torch.save(to_plain_cpu(state.batch), tmp / "batch.pt")
        if finding is not None and finding.samples and state.batch is not None:
            from nanaudit.run.batch import infer_layout, select_rows
            layout = infer_layout(state.batch, None)
            torch.save(to_plain_cpu(select_rows(state.batch, layout, list(finding.samples))),
                       tmp / "rows.pt")
        body = {"step": state.step, "check": trip.check, "scale": state.scale,
                "torch": torch.__version__,
                "samples": list(finding.samples or []) if finding else [], **meta}
        (tmp / "meta.json").write_text(json.dumps(body, indent=2, default=str) + "\n",
                                       encoding="utf-8")
        (tmp / "report.json").write_text(report_json, encoding="utf-8")
    folder = publish_bundle(folder, fill)
    return folder
