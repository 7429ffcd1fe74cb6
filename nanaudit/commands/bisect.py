"""`nanaudit bisect`: every poisoned batch of a data set, or the first bad checkpoint of a run.

Over a data set the model is held at its starting state (no updates), one cheap sentinel pass
visits every batch, and only the batches that trip are replayed with instruments. Over a
checkpoint folder, non-finite state is monotone once it appears, so a binary search loads
O(log C) checkpoints; training is then replayed from the last good one to the first bad step.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanaudit.commands.common import (
    ScanOptions,
    base_report,
    configured,
    guarded,
    nothing_audited,
)
from nanaudit.config.schema import Config
from nanaudit.errors import (
    ConfigError,
    NothingAuditedError,
    Problem,
    UsageError,
)
from nanaudit.localize.data_replay import reread, trace_inputs
from nanaudit.localize.findings import build_finding
from nanaudit.report.model import Finding, Report
from nanaudit.report.sections import CheckpointBisect, CheckpointRef, DataBisect, SkipEntry
from nanaudit.report.vocabulary import Check, Status, Where
from nanaudit.run.batch import batch_fingerprint, infer_layout, sample_ids, select_rows
from nanaudit.run.checkpoint import apply_model_state, load_checkpoint
from nanaudit.run.loop import run_steps
from nanaudit.run.session import Session, load_training_state
from nanaudit.run.step import ScanOutcome
from nanaudit.run.timeline import report_timeline


def bisect(config_path: str | Path, options: ScanOptions | None = None,
           checkpoints: Path | None = None, pattern: str | None = None) -> Report:
    """`nanaudit bisect`: every bad batch of the data set, or the first bad checkpoint."""
    options = options if options is not None else ScanOptions()
    report = base_report(config_path, None)
    report.command = "bisect"

    def body() -> None:
        from nanaudit.run.distributed import launched_by_torchrun
        if launched_by_torchrun():
            raise UsageError("bisect runs in one process: run it without torchrun (it replays "
                             "batches one by one against fixed weights)")
        config = configured(config_path, options)
        report.config = config.summary()
        if checkpoints is None:
            _bisect_data(config, options, report)
        else:
            _bisect_checkpoints(config, options, report, checkpoints, pattern)
    return guarded(report, body)


def _bisect_data(config: Config, options: ScanOptions, report: Report) -> None:
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.run.session import build_session
    with user_import_path(config.base_dir):
        session = build_session(config)
        report.device = str(session.device)
        if options.on_start:
            options.on_start(config.steps)
        result = bisect_data(session, config.steps, on_step=options.on_step)
    outcome = result["outcome"]
    report.steps_run = outcome.steps_run
    report.timeline, report.timeline_summary = report_timeline(outcome.timeline)
    if outcome.steps_run == 0:
        raise NothingAuditedError(nothing_audited(config))
    findings = result["findings"]
    report.status = (Status.INTERRUPTED if outcome.interrupted else
                     Status.NONFINITE if findings else Status.CLEAN)
    report.finding = findings[0] if findings else None
    report.bisect = DataBisect(batches_audited=outcome.steps_run, bad_batches=findings,
                               skip_list=result["skip_list"])


def _bisect_checkpoints(config: Any, options: Any, report: Report, folder: Path,
                        pattern: Any) -> None:
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.localize.findings import build_finding, state_finding
    from nanaudit.run.session import build_session
    from nanaudit.run.step import Trip
    files = list_checkpoints(Path(folder), pattern)
    with user_import_path(config.base_dir):
        session = build_session(config)
        report.device = str(session.device)
        section, outcome = bisect_checkpoints(session, files)
        section.note = section.note or linear_cost_note(section)
        report.bisect = section
        if section.first_bad is None:
            report.status = Status.CLEAN
            return
        report.status = Status.NONFINITE
        if outcome is not None:
            report.steps_run = outcome.steps_run
            report.timeline, report.timeline_summary = report_timeline(outcome.timeline)
        if outcome is not None and outcome.trip is not None:
            report.finding = build_finding(session, outcome, config.localize.samples)
            state = outcome.state
            # A batch the data gives differently on a second pass (shuffling or augmentation
            # outside the seeded RNG): its rows cannot be confirmed to be the same samples.
            if state is not None and state.batch_index is not None and reread(
                    session, {state.batch_index: batch_fingerprint(state.batch)}):
                mark_unconfirmed(report.finding)
        else:
            from nanaudit.run.checkpoint import apply_model_state, load_checkpoint
            bad = section.first_bad
            apply_model_state(session.model, load_checkpoint(Path(bad.path)), "--checkpoints",
                              bad.path)
            report.finding = state_finding(session, Trip(bad.step, Check.PARAMETER))
            report.finding.qualify(
                f"{bad.path}; the replay from the last good checkpoint did not reach a "
                f"non-finite value" + ("" if section.optimizer_state else
                                       ": the checkpoint holds no optimizer state, so a fresh "
                                       "optimizer may not follow the original trajectory")
                if section.last_good else f"{bad.path}: the first checkpoint")


DEFAULT_PATTERN = r"(\d+)\D*\.(?:pt|pth|ckpt|bin)$"


def bisect_data(session: Session, max_steps: int | None, on_step: Any = None) -> dict:
    """Audit every batch against the starting weights; localize each one that trips.

    A batch can hold bad rows of several kinds (a NaN input in one row, a log(0) in another):
    once a finding names its rows, the rest of the batch is audited again without them, until
    it is clean, so the skip list holds every bad row whatever its kind."""
    bad: list[tuple[Finding, list | None]] = []
    seen: dict[int, list] = {}   # data index -> the batch's fingerprint

    def on_trip(trip: Any, state: Any) -> None:
        outcome = ScanOutcome(trip=trip, state=state, steps_run=state.step + 1)
        seen.setdefault(state.batch_index, batch_fingerprint(state.batch))
        for finding in _every_finding(session, outcome):
            bad.append((finding, sample_ids(state.batch, finding.samples)))

    # The user's own step makes its updates itself: each is put back after the call.
    held = hasattr(session.unit, "hold_weights")
    if held:
        session.unit.hold_weights = True
    try:
        outcome = run_steps(session, max_steps, update=False, on_step=on_step,
                            stop_on_trip=False, on_trip=on_trip)
    finally:
        if held:
            session.unit.hold_weights = False
    # Read again to confirm the rows; on the way, name what made each non-finite batch.
    inputs: dict = {}
    for finding, _ in bad:
        if finding.where == Where.INPUT and finding.batch_index is not None:
            inputs.setdefault(finding.batch_index, finding)
    changed = set(trace_inputs(session, seen, inputs))
    for finding, _ in bad:
        if finding.batch_index in changed:
            mark_unconfirmed(finding)
    # `batch` is the data index (with accumulation, not the optimizer step).
    skip = [SkipEntry(batch=f.batch_index if f.batch_index is not None else f.step,
                      rows=f.samples, sample_ids=ids, cause=f.cause,
                      confirmed=False if f.batch_index in changed else None)
            for f, ids in bad]
    return {"outcome": outcome, "findings": [f for f, _ in bad], "skip_list": skip}


def mark_unconfirmed(finding: Finding) -> None:
    finding.explain(
        f"the rows could not be confirmed: read a second time, the data gave a different batch "
        f"{finding.batch_index} (shuffling or random augmentation outside the seeded RNG), so "
        f"the rows name the batch nanaudit saw, which the data may not give again")
    search = finding.sample_search
    if search is not None:
        note = "rows not confirmed: the data is not repeatable"
        finding.sample_search = replace(search, note=f"{search.note}; {note}" if search.note
                                        else note)


def _every_finding(session: Session, outcome: ScanOutcome) -> list:
    """The batch's finding, then those of the rows that remain once its rows are set aside."""
    state = outcome.state
    assert state is not None, "a tripped outcome carries its step's state"
    findings = [build_finding(session, outcome, session.options.localize.samples)]
    layout = infer_layout(state.batch, session.options.batch_dim)
    remaining = list(range(layout.size or 0))
    while findings[-1].samples and layout.size:
        taken = set(findings[-1].samples)
        remaining = [r for r in remaining if r not in taken]
        if not remaining:
            break
        rest = select_rows(state.batch, layout, remaining)
        # The rest as the only batch at the same step: same weights (no updates), same RNG.
        probe = replace(session, make_data=functools.partial(itertools.repeat, rest,
                                                             state.step + 1))
        again = run_steps(probe, 1, update=False, start_step=state.step)
        if again.trip is None:
            break
        finding = build_finding(probe, again, session.options.localize.samples)
        _renumber(finding, remaining, layout.size)
        findings.append(finding)
    return findings


def _renumber(finding: Finding, remaining: list[int], size: int) -> None:
    """Rows of the reduced batch back to the full batch's numbering."""
    local = finding.samples or []
    finding.samples = [remaining[r] for r in local if r < len(remaining)] or None
    finding.sample_rows = [replace(row, index=remaining[row.index])
                           for row in finding.sample_rows if row.index < len(remaining)]
    if finding.samples:
        finding.qualify(f"found once the rows of the earlier finding were set aside: the row "
                        f"numbers above count the {len(remaining)} remaining of {size}; in the "
                        f"full batch they are {finding.samples}")


@dataclass(frozen=True)
class CheckpointFile:
    step: int
    path: Path


def list_checkpoints(folder: Path, pattern: str | None = None) -> list[CheckpointFile]:
    if not folder.is_dir():
        raise ConfigError([Problem("--checkpoints", f"not a folder: {folder}")])
    try:
        regex = re.compile(pattern or DEFAULT_PATTERN)
    except re.error as exc:
        raise ConfigError([Problem("--pattern", f"not a regular expression: {exc}")]) from None
    found, unmatched = [], []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        match = regex.search(path.name)
        if match is None:
            unmatched.append(path.name)
            continue
        try:
            found.append(CheckpointFile(int(match.group(1)), path))
        except (IndexError, ValueError):
            raise ConfigError([Problem("--pattern", f"the pattern must capture the step number "
                                       f"as its first group, got {regex.pattern!r}")]) from None
    if not found:
        hint = (f" (files without a step in the name: {', '.join(unmatched[:5])})"
                if unmatched else "")
        raise ConfigError([Problem("--checkpoints", f"no checkpoint files with a step number in "
                                   f"{folder}{hint}; names like step_000100.pt or ckpt-2000.pt, "
                                   f"or pass --pattern")])
    steps = [c.step for c in found]
    if len(set(steps)) != len(steps):
        raise ConfigError([Problem("--checkpoints", f"two files carry the same step in {folder}")])
    return sorted(found, key=lambda c: c.step)


def _state_is_finite(checkpoint: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in checkpoint.model_state.values()
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def first_bad_checkpoint(files: list[CheckpointFile]) -> Any:
    """Binary search, assuming once non-finite always non-finite. Returns (index, loads)."""
    loads = []

    def bad(i: Any) -> Any:
        loads.append(files[i].step)
        return not _state_is_finite(load_checkpoint(files[i].path, key="--checkpoints"))

    lo, hi = 0, len(files)          # invariant: files[:lo] good, files[hi:] bad
    while lo < hi:
        mid = (lo + hi) // 2
        if bad(mid):
            hi = mid
        else:
            lo = mid + 1
    return (lo if lo < len(files) else None), loads


def bisect_checkpoints(session: Session, files: list[CheckpointFile]
                       ) -> tuple[CheckpointBisect, ScanOutcome | None]:
    """The first bad checkpoint, and the replay of training to it from the last good one (the
    outcome; None when there is no good one before it)."""
    index, loads = first_bad_checkpoint(files)
    section = CheckpointBisect(checkpoints=len(files), checkpoints_loaded=len(loads),
                               loaded_steps=loads,
                               linear_loads=len(files) if index is None else index + 1)
    if index is None:
        return section, None
    section.first_bad = CheckpointRef(files[index].step, str(files[index].path))
    if index == 0:
        section.note = "the first checkpoint is already non-finite"
        return section, None
    good = files[index - 1]
    section.last_good = CheckpointRef(good.step, str(good.path))
    checkpoint = load_checkpoint(good.path, key="--checkpoints")
    apply_model_state(session.model, checkpoint, "--checkpoints", str(good.path))
    session.model.to(session.device)
    has_optimizer = (("optimizer" in checkpoint.raw or "optimizers" in checkpoint.raw)
                     and session.optimizer is not None)
    load_training_state(checkpoint.raw, session.optimizers, session.schedulers)
    section.optimizer_state = has_optimizer
    outcome = run_steps(session, files[index].step - good.step, start_step=good.step)
    section.steps_replayed = outcome.steps_run - good.step if outcome.steps_run else 0
    section.reproduced = outcome.trip is not None
    return section, outcome


def linear_cost_note(section: CheckpointBisect) -> str:
    c = section.checkpoints
    return (f"loaded {section.checkpoints_loaded} of {c} checkpoints (a linear scan loads up "
            f"to {c}; binary search needs at most {math.ceil(math.log2(c + 1))})")
