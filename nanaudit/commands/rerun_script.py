"""The re-run of `nanaudit run`: `python -m nanaudit.commands.rerun_script SPEC` runs the script again from
the start with the OpTracer armed for the bad step only, and writes back the finding and the
losses it saw (to check the re-run followed the first run)."""

from __future__ import annotations

import pickle
import sys

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.errors import UserCodeError
from nanaudit.localize.events import kinds_of
from nanaudit.localize.stats import forward_input_stats, input_stats
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.walk import walk_from_sink
from nanaudit.report.model import ChainLink, Finding, SampleSearch
from nanaudit.run.batch import nonfinite_rows
from nanaudit.run.script_hooks import ScriptAuditor


def localized_finding(auditor: ScriptAuditor, step: int,
                      check: str) -> tuple[Finding | None, int, str | None]:
    """The finding of the traced step N (None when it came out finite), the ops traced and the
    creating op's precision."""
    armed, optimizer = auditor.armed, auditor.localized
    if armed is None or optimizer is None:
        return None, 0, None
    trace = armed.tracer.trace
    names = None
    if check == "loss":
        sinks = [s for s in armed.sinks if kinds_of(s)]
        if not sinks:
            return None, trace.ops_seen, None
        loc = walk_from_sink(trace, sinks[0], "forward", auditor.timeline, None)
    else:
        bad = [(auditor.parameter_name(p), p) for group in optimizer.param_groups
               for p in group["params"] if p.grad is not None and kinds_of(p.grad)]
        if not bad:
            return None, trace.ops_seen, None
        names = [n for n, _ in bad]
        loc = walk_from_sink(trace, bad[0][1].grad, "backward", auditor.timeline, names)
    return _finding(armed, loc, step, names)


def raised_finding(auditor: ScriptAuditor, step: int) -> tuple[Finding | None, int, str | None]:
    """The finding of a step N the script raised in (BCELoss refusing a NaN input): walked back
    from the last non-finite value the tracer saw before the exception, to the op that made
    it; None when the step held none (the exception was not about such a value)."""
    armed = auditor.armed
    trace = armed.tracer.trace
    sinks = [t for t in reversed(armed.tracer._keep)
             if trace.producer_of(t) is not None and kinds_of(t)]
    if not sinks:
        return None, trace.ops_seen, None
    phase = trace.events[trace.producer_of(sinks[0])].phase
    loc = walk_from_sink(trace, sinks[0], phase, auditor.timeline, None)
    finding, ops, precision = _finding(armed, loc, step, None)
    if finding is not None:
        finding.tensor = None
    return finding, ops, precision


def _finding(armed, loc, step: int, names) -> tuple[Finding | None, int, str | None]:
    trace = armed.tracer.trace
    if not loc.reproduced:
        return None, trace.ops_seen, None
    event = loc.event
    finding = Finding(
        step=step, where=event.phase, value=loc.kind, cause=loc.diagnosis.cause,
        explanation=loc.diagnosis.explanation, fix=loc.diagnosis.fix, op=event.op,
        forward_op=event.forward.op if event.phase == "backward" and event.forward else None,
        module=event.module, source=event.source, inputs=input_stats(event),
        forward_inputs=forward_input_stats(event) if event.phase == "backward" else [],
        reproduced=True, tensors=names or [],
        tensor=names[0] if names else "loss",
        chain=[ChainLink(e.op, e.phase, e.module, sorted(e.out_kinds),
                         e.source.line if e.source else None) for e in loc.chain])
    rows = created_rows(armed, event)
    if rows and len(rows) < armed.batch_size:
        finding.samples = rows
        finding.sample_search = SampleSearch(
            armed.batch_size, 0, False,
            f"the rows whose slice of {event.op}'s output went non-finite")
    elif rows:
        # Every row: the weights or the op, not particular samples (no row to inspect).
        finding.sample_search = SampleSearch(
            armed.batch_size, 0, False,
            f"every row's slice of {event.op}'s output went non-finite: a batch-level value, "
            f"not particular samples")
    return finding, trace.ops_seen, event_precision(event)


def event_precision(event) -> str:
    """fp16 or bf16 when the creating op (or, for a backward op, its forward op) read or wrote
    that dtype (autocast's casts carry it as `dtype=`), else fp32: an overflow in float16 is
    the dtype's range, one in float32 after the weights grew is divergence."""
    dtypes = set()
    for record in (event, event.forward):
        if record is None or getattr(record, "args", None) is None:
            continue
        for leaf in tree_flatten((record.args, record.kwargs or {}))[0]:
            dtypes.add(leaf.dtype if isinstance(leaf, torch.Tensor) else leaf)
    if torch.float16 in dtypes:
        return "fp16"
    return "bf16" if torch.bfloat16 in dtypes else "fp32"


def created_rows(armed, event) -> list[int] | None:
    """For a forward-created value: the batch rows whose slice of the op's output is bad."""
    size = armed.batch_size
    if event.phase != "forward" or not size:
        return None
    trace = armed.tracer.trace
    outputs = [t for t in armed.tracer._keep if trace.producer.get(id(t)) == event.index]
    rows = set()
    for t in outputs:
        if t.dim() >= 1 and t.shape[0] == size:
            rows.update(nonfinite_rows(t.detach(), 0))
    return sorted(rows) or None


def main(spec_path: str) -> int:
    from nanaudit.commands.run_script import execute, rerun_failure
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    auditor = ScriptAuditor(rerun_step=spec["step"], expected_losses=spec["losses"],
                            rerun_evaluation=spec.get("evaluation", 0), tracer=OpTracer)
    result = {"timeline": [], "finding": None, "reached": False, "trip": None, "error": None}
    try:
        try:
            execute(spec["target"], auditor, spec["seed"])
        except UserCodeError:
            # The first run's script raised in step N after a non-finite value: so does this
            # one, inside the traced window (earlier, it left the first run: not reached).
            if spec["check"] != "error" or auditor.step != spec["step"]:
                raise
            auditor._disarm()
            result["reached"] = True
            result["traced"] = auditor.armed is not None
            if auditor.armed is not None:
                finding, result["ops_traced"], result["precision"] = raised_finding(
                    auditor, spec["step"])
                result["finding"] = finding
        else:
            result["reached"] = auditor.localized is not None
            result["traced"] = auditor.armed is not None
            if result["reached"]:
                finding, result["ops_traced"], result["precision"] = localized_finding(
                    auditor, spec["step"], spec["check"])
                result["finding"] = finding
    except Exception as exc:
        result["error"] = rerun_failure(exc)
    result["timeline"] = auditor.timeline
    result["trip"] = auditor.trip
    with open(spec["result"], "wb") as f:
        pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
