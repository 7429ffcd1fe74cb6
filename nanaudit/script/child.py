"""The re-run of `nanaudit run`, in a fresh process: `python -m nanaudit.script.child SPEC
RESULT` runs the script again from the start with the op tracer armed for the bad step only,
and writes back the finding there and the losses it saw on the way (the parent checks that the
re-run followed the first run before it believes the finding)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from nanaudit.errors import UserCodeError
from nanaudit.localize.events import kinds_of
from nanaudit.localize.findings import event_precision
from nanaudit.localize.replay_finding import finding_at, raised_sink, walk_raised
from nanaudit.localize.sharded_replay import made_here, own_sink
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.sharded import local_shards
from nanaudit.script import protocol
from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.before_rerun import BeforeWindow
from nanaudit.script.compiled_rerun import compiled_rerun_finding, eager_section
from nanaudit.script.data_window import DataWindow
from nanaudit.script.model_skip import ModelSkip
from nanaudit.script.protocol import RerunFailure, RerunResult, RerunSpec
from nanaudit.script.rerun_window import Armed, RerunWindow
from nanaudit.script.target import execute, script_rank
from nanaudit.script.weight_history import LedgerWeights


def localize_step(auditor: ScriptAuditor, spec: RerunSpec, result: RerunResult) -> None:
    """The finding of the traced step N from its loss or gradients (none: it came out
    finite)."""
    armed, optimizer = auditor.window.armed, auditor.window.localized
    if armed is None or (optimizer is None and spec.check != Check.LOSS):
        return
    trace = armed.tracer.trace
    result.ops_traced = trace.ops_seen
    if spec.buffers:
        # Buffers the forward made non-finite: walked back from the first bad one.
        bad = auditor.buffers.nonfinite()
        if bad:
            names = [n for n, _ in bad]
            _adopt(armed, walk_from_sink(trace, bad[0][1], Where.FORWARD, auditor.timeline, names,
                                         f"the buffer {names[0]}"),
                   spec.step, names, result, auditor.rank)
    elif spec.check == Check.LOSS:
        sinks = [s for s in armed.sinks if kinds_of(s)]
        if sinks:
            _adopt(armed, walk_from_sink(trace, sinks[0], Where.FORWARD, auditor.timeline, None),
                   spec.step, None, result, auditor.rank, auditor.window)
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        bad = [(auditor.parameter_name(p), g) for p, g in zip(params, local_shards(
            [p.grad for p in params])) if kinds_of(g)]
        # Under FSDP this rank's own gradients before the reduce-scatter: its shard after it
        # may hold a peer's value, or none of its own.
        own = own_sink(auditor.ranks.flags) if auditor.ranks else None
        if bad or own is not None:
            names = [n for n, _ in bad]
            sink = own if own is not None else bad[0][1]
            loc = walk_from_sink(trace, sink, Where.BACKWARD, auditor.timeline, names)
            _adopt(armed, loc, spec.step, names, result, auditor.rank, auditor.window)
    if armed.compiled is not None:
        # A compiled model: the trace ran it eagerly; finite there, the compiled call decides.
        if result.finding is not None:
            result.finding.compiled = eager_section(armed.compiled)
        else:     # the parent names the tensors the first run saw
            result.finding = compiled_rerun_finding(armed.compiled, spec.step, spec.check)


def localize_raised(auditor: ScriptAuditor, spec: RerunSpec, result: RerunResult) -> None:
    """The finding of a step N the script raised in (BCELoss refusing a NaN input): walked back
    from the last non-finite value the tracer saw before the exception, to the op that made
    it; none when the step held none (the exception was not about such a value)."""
    armed = auditor.window.armed
    if armed is None:
        return
    result.ops_traced = armed.tracer.trace.ops_seen
    sink = raised_sink(armed.tracer)
    if sink is None:
        return
    _adopt(armed, walk_raised(armed.tracer, sink, auditor.timeline), spec.step, None, result,
           auditor.rank, raised=True)
    if result.finding is not None:
        result.finding.tensor = None


def _weights(auditor: ScriptAuditor) -> LedgerWeights:
    """Who updated the parameters in this run (the overflow an update made: weight_growth)."""
    return LedgerWeights(auditor.ledger, auditor.log.first_norms)


def _adopt(armed: Armed, loc: Localization, step: int, names: list | None,
           result: RerunResult, rank: int | None, window: RerunWindow | None = None,
           raised: bool = False) -> None:
    if not loc.reproduced or loc.event is None:
        return
    if rank is not None and not made_here(loc):
        result.received = True          # under torchrun: it arrived from a peer
        return
    finding = finding_at(armed.tracer, loc, step, names, armed.batch_size)
    finding.rank = rank
    finding.micro_batch = armed.micro_batch(loc.event.index, raised)
    if isinstance(window, BeforeWindow):
        window.made_before(armed.tracer, loc, finding)
    result.finding, result.precision = finding, event_precision(loc.event)


def rerun(spec: RerunSpec) -> RerunResult:
    # Without the model its losses are not the first run's: none to compare (the bad batch's
    # fingerprint is compared instead, by the parent).
    losses = None if spec.skip_model else dict(spec.losses)
    auditor = ScriptAuditor(rerun_step=spec.step, expected_losses=losses,
                            rerun_evaluation=spec.evaluation, rerun_skips=spec.skips,
                            tracer=OpTracer,
                            rank=script_rank())
    # The step's tracer knows who grew which weights before its ops run: an op reading grown
    # ones keeps its inputs, for an overflow they made downstream (weight_growth.py).
    tracer = auditor.window.tracer = functools.partial(OpTracer, weights=_weights(auditor))
    result = RerunResult()
    skip = None
    if spec.check == Check.INPUT:           # the batch was bad: trace the data code instead
        window = auditor.window = DataWindow(spec.step, tracer, spec.trace_from)
        if spec.skip_model:
            skip = window.skip = ModelSkip(spec.step, lambda: auditor.step).install()
        window.start()
    elif spec.before:                 # the value was made before step N's first model call
        before = auditor.window = BeforeWindow(spec.step, spec.evaluation, tracer, spec.skips)
        before.start()
        # The step's loss code recorded as the first run's is: a loss it skipped before
        # backward (an EMA copy's evaluation) is heard, and is the sink.
        auditor.hooks.tap.enabled = True
    try:
        _run(auditor, spec, result)
    finally:
        if skip is not None:
            skip.remove()
            result.stood_in, result.computed = skip.stood_in, skip.computed
            result.abandoned = skip.abandoned
    return result


def _run(auditor: ScriptAuditor, spec: RerunSpec, result: RerunResult) -> None:
    try:
        try:
            execute(spec.target, auditor, spec.seed)
        except UserCodeError:
            # The first run's script raised in step N after a non-finite value: so does this
            # one, inside the traced window (earlier, it left the first run: not reached).
            if spec.check != Check.ERROR or auditor.step != spec.step:
                raise
            auditor.window.close()
            result.reached = True
            result.traced = auditor.window.armed is not None
            localize_raised(auditor, spec, result)
        else:
            window = auditor.window
            # The script ended inside step N's window, on the loss it saw (it exits or skips
            # its update on a NaN loss): the window ends with the script.
            ended_inside = (spec.check == Check.LOSS and auditor.step == spec.step
                            and window.armed is not None and window.localized is None)
            result.reached = window.localized is not None or ended_inside
            result.traced = auditor.window.armed is not None
            if result.reached and isinstance(auditor.window, DataWindow) \
                    and auditor.window.inputs is not None:      # stopped at step N's bad batch
                auditor.window.localize(result)
            elif result.reached:
                localize_step(auditor, spec, result)
    except Exception as exc:
        result.error = RerunFailure.of(exc)
    result.timeline = auditor.timeline
    result.trip = auditor.trip


def main(spec_path: str, result_path: str) -> int:
    protocol.write(Path(result_path), rerun(protocol.read_spec(spec_path)))
    if script_rank() is not None:
        # Under torchrun the script's process group and sharded model are still alive: leave
        # without the interpreter's teardown, which can abort in gloo's destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
