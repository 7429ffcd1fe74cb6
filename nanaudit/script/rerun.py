"""The re-run of `nanaudit run`: the script again from the start in a fresh process, with the
same argv, environment and seeds, the op tracer armed for the bad step only. The re-run must
reproduce the first run's losses before that step; if it does not, the script is not
deterministic and the report says so with what the first run saw, never a guess."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from nanaudit.config.schema import DistributedOptions
from nanaudit.report.model import Finding, TimelineEntry
from nanaudit.report.output import in_flight
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import Check, CompiledOutcome, ProducerKind, RerunStatus
from nanaudit.run.distributed import current
from nanaudit.script import protocol
from nanaudit.script.data_window import ModelRun, same_inputs, unusable
from nanaudit.script.findings import not_deterministic, number, trip_notes
from nanaudit.script.inprocess import RE_RUN
from nanaudit.script.protocol import RerunResult, RerunSpec
from nanaudit.script.ranks import rerun_environment
from nanaudit.script.scratch import FolderState, inside, prepare, relocated
from nanaudit.script.step_values import same_value
from nanaudit.script.target import ScriptOptions, ScriptTarget, script_rank
from nanaudit.script.trip import ScriptTrip

CHILD_MODULE = "nanaudit.script.child"     # run as `python -m` (test_layout sees the name)


def localize_by_rerun(target: ScriptTarget, options: ScriptOptions, trip: ScriptTrip,
                      timeline: Sequence[TimelineEntry], finding: Finding,
                      before: FolderState | None = None) -> tuple[Rerun, Finding]:
    """Re-run the script to `trip.step` with the tracer armed for that step, in a scratch
    copy of the working folder as `before` lists it (scratch.py): the re-run's record, and the
    finding (the re-run's when it reproduced the value, else the first run's with the reason
    the op is not named)."""
    skipped = _why_not(options, trip)
    if skipped is not None:
        finding.explain(skipped[1])
        return Rerun(status=RerunStatus.SKIPPED, note=skipped[0]), finding
    if options.on_rerun is not None:
        options.on_rerun(trip.step)
    started = time.perf_counter()
    model = ModelRun()
    if options.skip_model and trip.check == Check.INPUT and script_rank() is None:
        result, log_tail, folder_note, model = _without_model(target, options, trip, timeline,
                                                              before, started)
    if not model.skipped:
        result, log_tail, folder_note = run_child(target, options, trip, timeline, before)
    if folder_note is not None:
        finding.explain(folder_note)
    took = round(time.perf_counter() - started, 3)
    steps = trip.step + 1

    def ran(status: RerunStatus, note: str | None = None, log_tail: str | None = None,
            ops_traced: int | None = None, precision: str | None = None) -> Rerun:
        return Rerun(steps=steps, duration_s=took, status=status, note=note, log_tail=log_tail,
                     ops_traced=ops_traced, precision=precision, **model.fields())
    if result is None or result.error is not None:
        message = result.error.message if result is not None and result.error else \
            "it wrote no result"
        note = f"the re-run failed: {message}"
        finding.explain(note)
        return ran(RerunStatus.FAILED, note=note, log_tail=log_tail), finding
    # Without the model its losses differ by design: its batch's fingerprint was compared.
    mismatch = None if model.skipped else \
        compare_losses(timeline, result, trip.step) or same_inputs(trip, result)
    if mismatch is not None:
        not_deterministic(finding, mismatch)
        return ran(RerunStatus.NONDETERMINISTIC, note=mismatch), finding
    if result.finding is None:
        status, note = _unlocalized(result, trip.step)
        if status is RerunStatus.NOT_REPRODUCED:
            finding.reproduced = False
        finding.explain(note)
        return ran(status, note=note), finding
    localized = result.finding
    localized.localized_by = RE_RUN
    said = model.said(steps, took)
    if said is not None:
        localized.explain(said)
    if folder_note is not None:
        localized.explain(folder_note)
    localized.tensors = localized.tensors or finding.tensors
    localized.tensor = localized.tensor or finding.tensor
    if localized.rank is None:           # torchrun: the re-run names the rank that made it
        localized.rank = trip.rank
    if localized.micro_batch is None:    # an input trip's: the first run counted the window
        localized.micro_batch = trip.micro_batch
    for note in trip_notes(trip):
        localized.explain(note)
    compiled = localized.compiled
    status = RerunStatus.REPRODUCED
    if compiled is not None and compiled.outcome == CompiledOutcome.COMPILED_ONLY:
        status, localized.value = RerunStatus.COMPILED_ONLY, finding.value   # as the run saw it
    return ran(status, ops_traced=result.ops_traced, precision=result.precision), localized


def _without_model(target: ScriptTarget, options: ScriptOptions, trip: ScriptTrip,
                   timeline: Sequence[TimelineEntry], before: FolderState | None,
                   started: float) -> tuple[RerunResult | None, str, str | None, ModelRun]:
    """The re-run of an input trip with the model stood in for before the bad step
    (model_skip.py), first tracing only the set-up's and the last steps' data code: an op found
    there made the value (its inputs were finite); anything else may lie in the untraced
    steps, traced then in a second try. When the data depends on the model
    (data_window.unusable) the caller re-runs in full, and the report says why."""
    # The first step whose data code is traced: N - 1 first (at step 2 or before, tracing
    # from the start leaves out no more than a step); from the start when no op was found.
    late = trip.step - 1 if trip.step > 2 else 0
    result, log_tail, folder_note = run_child(target, options, trip, timeline, before,
                                              skip_model=True, trace_from=late)
    why = unusable(trip, result)
    if why is None and late and not _op_made(result):
        result, log_tail, folder_note = run_child(target, options, trip, timeline, before,
                                                  skip_model=True, trace_from=0)
        why = unusable(trip, result)
    if why is not None:
        return result, log_tail, folder_note, ModelRun(
            False, note=why, tried_s=round(time.perf_counter() - started, 3))
    assert result is not None and result.finding is not None
    return result, log_tail, folder_note, ModelRun(True, result.stood_in,
                                                   computed=result.computed)


def _op_made(result: RerunResult | None) -> bool:
    """Did the traced data code's op make the batch's value (a usable result's finding)?"""
    assert result is not None and result.finding is not None
    producer = result.finding.producer
    return producer is not None and producer.made_by == ProducerKind.TORCH_OP


def _why_not(options: ScriptOptions, trip: ScriptTrip) -> tuple[str, str] | None:
    """(the re-run's note, the finding's clause) when the re-run is not made; else None."""
    steps = trip.step + 1
    if options.no_rerun_because is not None:
        return options.no_rerun_because, options.no_rerun_because
    if not options.rerun:
        return "--no-rerun", "not re-run (--no-rerun): the op is not named"
    if options.max_rerun_steps is not None and steps > options.max_rerun_steps:
        note = (f"not re-run: localizing step {trip.step} repeats {steps} steps, more than "
                f"--max-rerun-steps {options.max_rerun_steps}")
        return note, note
    if script_rank() is not None and current() is None:
        note = ("not re-run under torchrun: the script's ranks joined no process group to "
                "re-run together; run the script on one process, or move to a YAML config "
                "(`nanaudit scan`), to name the op")
        return note, note
    return None


def _unlocalized(result: RerunResult, step: int) -> tuple[RerunStatus, str]:
    if result.received:
        return RerunStatus.NOT_REPRODUCED, (
            f"on this rank the value of step {step} arrived from a peer rank through a "
            f"collective: none of its own ops made it")
    if not result.traced:
        return RerunStatus.NOT_TRACED, (
            f"the re-run reached step {step} but no module was called with autograd between "
            f"step {step - 1}'s update and step {step}'s optimizer step (the re-run's tracer "
            f"arms at such a call): nothing was traced, so the op is not named")
    return RerunStatus.NOT_REPRODUCED, (
        f"the re-run matched the first run's losses up to step {step}, but its step {step} came "
        f"out finite under the tracer: a non-deterministic kernel or a transient fault, not a "
        f"reproducible bug in this step")


def run_child(target: ScriptTarget, options: ScriptOptions, trip: ScriptTrip,
              timeline: Sequence[TimelineEntry], before: FolderState | None = None,
              skip_model: bool = False, trace_from: int = 0,
              ) -> tuple[RerunResult | None, str, str | None]:
    """Run `python -m nanaudit.script.child SPEC RESULT` in a scratch copy of the folder
    (scratch.py), in the same environment; (its result or None, the tail of its output, what
    the report says of the folder it ran in)."""
    with tempfile.TemporaryDirectory(prefix="nanaudit-rerun-") as folder, in_flight(folder):
        scratch = prepare(before, Path(folder) / "work")
        if target.path is not None:
            target = replace(target, path=inside(target.path, before, scratch))
        result, tail = _child(target, options, trip, timeline, Path(folder), scratch.folder,
                              skip_model, trace_from)
        if result is not None and result.finding is not None:
            result.finding = relocated(result.finding, scratch, os.getcwd())
        return result, tail, scratch.note


def _child(target: ScriptTarget, options: ScriptOptions, trip: ScriptTrip,
           timeline: Sequence[TimelineEntry], folder: Path, cwd: str,
           skip_model: bool, trace_from: int) -> tuple[RerunResult | None, str]:
    spec = RerunSpec(target=target, seed=options.seed, step=trip.step, check=trip.check,
                     evaluation=trip.evaluation, skips=trip.skips, buffers=trip.in_buffers,
                     losses=tuple((e.step, e.loss) for e in timeline if e.step < trip.step),
                     skip_model=skip_model, trace_from=trace_from, before=trip.made_before)
    env = rerun_environment()          # torchrun: every rank re-runs, together
    timeout = options.rerun_timeout_s
    if env is not None and timeout is None:
        timeout = DistributedOptions.timeout_s      # a peer's re-run that stalls: no hang
    spec_path, result_path = folder / "spec.pkl", folder / "result.pkl"
    log_path = folder / "rerun.log"
    protocol.write(spec_path, spec)
    with open(log_path, "wb") as log:
        try:
            subprocess.run([sys.executable, "-m", CHILD_MODULE, str(spec_path),
                            str(result_path)], cwd=cwd, env=env or dict(os.environ),
                           stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            pass
    tail = log_path.read_text(errors="replace")[-2000:]
    return protocol.read_result(result_path), tail


def compare_losses(first: Sequence[TimelineEntry], result: RerunResult,
                   step: int) -> str | None:
    """None when the re-run followed the first run to `step`; else what differed. A long run's
    timelines keep their first and last steps (run/timeline.py): those are compared."""
    rerun = {e.step: e for e in result.timeline}
    for old in first:
        new = rerun.get(old.step)
        if old.step >= step or new is None:
            continue
        if not same_value(old.loss, new.loss):
            return (f"the loss at step {old.step} was {number(old.loss)} in the first run and "
                    f"{number(new.loss)} in the re-run")
    if result.trip is not None:
        return (f"the re-run went non-finite earlier, at step {result.trip.step} "
                f"({result.trip.check})")
    if not result.reached:
        return (f"the re-run ended after {result.timeline.steps} step(s) without reaching "
                f"step {step}")
    return None
