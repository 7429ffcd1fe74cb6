"""`nanaudit run`'s localization at the trip, in the process that tripped: the bad step's window
(every micro-batch since the last check) replayed under the op tracer from the step record
(run/step_record.py): each model call on its own arguments with the RNG streams as it began and
the buffers as the window began, the recorded loss code on the replayed output, and backward
from the roots the script differentiated. The parameters and optimizer state are the step's own
(the check ran before the update).

The replay must reproduce what the first run saw (each micro-batch's loss, and the check that
tripped) before it names anything; when it does not, or cannot run, it says why and the caller
falls back to the re-run from the start. Afterwards the RNG streams, buffers and gradients are
as the trip left them. Its cost is one step's, whatever the step's number. Under torchrun the
rank that made the value replays its own step on its local module (DDP, DeepSpeed ZeRO-1/2),
or every rank replays it together (FSDP2, HSDP, tensor parallel), and every rank gets the
finding (rank_replay.py).

A compiled model's step call is replayed eagerly (the module's own `_call_impl`, its output
heard as the compiled call returned, compiled_calls.py); a loss the eager replay does not
reproduce is a value only the compiled program makes, which the re-run's compiled replay names
(compiled_rerun.py: it needs a traced step's output gradients). Error trips: error_replay.py."""

from __future__ import annotations

import linecache
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from nanaudit.localize.events import kinds_of
from nanaudit.localize.findings import event_precision
from nanaudit.localize.replay_finding import finding_at
from nanaudit.localize.tracer import REPLAYED_LINE, REPLAYED_MODULE, OpTracer
from nanaudit.localize.walk import walk_from_sink
from nanaudit.report.model import Finding, SourceLine
from nanaudit.report.sections import CompiledReplay, Rerun
from nanaudit.report.vocabulary import Check, CompiledOutcome, RerunStatus, Where
from nanaudit.run.compiled import find_compiled
from nanaudit.run.loss_code import autocast, replay
from nanaudit.run.step_record import ModelCall
from nanaudit.script.before_window import made_before_window
from nanaudit.script.code_batch import window_place
from nanaudit.script.findings import first_run_finding, link_warnings, trip_notes
from nanaudit.script.rank_replay import (
    local_backward,
    local_call,
    local_module,
    made_on_this_rank,
    own_gradient,
    replayed_on_ranks,
    replayed_together,
)
from nanaudit.script.replayable import NotReplayable, replay_allowed, replayable
from nanaudit.script.step_values import loss_mismatch
from nanaudit.script.target import ScriptOptions
from nanaudit.script.trip import ScriptTrip
from nanaudit.script.weight_history import LedgerWeights

IN_PROCESS, RE_RUN = "in-process", "re-run"     # a finding's `localized_by`
# A replay's (finding or None, ops traced, the creating op's precision or why it named none).
Replayed = tuple[Finding | None, int, str | None]


class MadeBefore(Exception):
    """The replay's walk ended at a value the script made before the step's first model call
    (before_window.py): the re-run names its maker. Carries why and the ops traced."""

    def __init__(self, why: str, ops: int) -> None:
        super().__init__(why)
        self.ops = ops


def localize_in_process(auditor: Any, options: ScriptOptions, trip: ScriptTrip,
                        timeline: Any) -> tuple[Rerun | None, Finding | None]:
    """(the replay's record, the finding it names; None: fall back to the re-run, the record's
    note says why). An input or error trip is the re-run's alone: no record."""
    if trip.check not in (Check.LOSS, Check.GRADIENT) and not trip.in_buffers:
        return None, None
    ranks = auditor.ranks
    if ranks is None:
        return _localized_here(auditor, options, trip, timeline)
    # torchrun: the origin's replay (FSDP2: every rank's), shared with every rank.
    return replayed_on_ranks(ranks, trip.rank,
                             lambda: _localized_here(auditor, options, trip, timeline),
                             lambda: _refusal(auditor, options, trip))


def _refusal(auditor: Any, options: ScriptOptions, trip: ScriptTrip) -> str | None:
    """Why this process cannot replay the window (None: it can)."""
    try:
        _window(auditor, options, trip)
    except NotReplayable as why:
        return str(why)
    return None


def _localized_here(auditor: Any, options: ScriptOptions, trip: ScriptTrip,
                    timeline: Any) -> tuple[Rerun | None, Finding | None]:
    """`localize_in_process` in this process alone."""
    return timed_replay(lambda: _replayed(auditor, _window(auditor, options, trip), trip,
                                          timeline))


def timed_replay(replayed: Callable[[], Replayed]) -> tuple[Rerun | None, Finding | None]:
    """(the record, the finding) of `replayed()`: (the finding or None, the ops traced, the
    creating op's precision or why it named none); NotReplayable is a skipped record."""
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # The step's ops again: the warnings they raise were the run's, shown once.
            warnings.simplefilter("ignore")
            finding, ops, precision = replayed()
    except NotReplayable as why:
        return Rerun(status=RerunStatus.SKIPPED, note=str(why)), None
    except MadeBefore as why:
        return Rerun(steps=1, duration_s=round(time.perf_counter() - started, 3),
                     status=RerunStatus.MADE_BEFORE, note=str(why), ops_traced=why.ops), None
    took = round(time.perf_counter() - started, 3)
    if finding is None:
        return Rerun(steps=1, duration_s=took, status=RerunStatus.NOT_REPRODUCED,
                     note=precision, ops_traced=ops), None
    finding.localized_by = IN_PROCESS
    return Rerun(steps=1, duration_s=took, status=RerunStatus.REPRODUCED, ops_traced=ops,
                 precision=precision), finding


def bad_step_finding(auditor: Any, options: ScriptOptions, trip: ScriptTrip) -> Finding:
    """The finding of a step --keep-going skips, localized at the trip in-process; a step the
    replay cannot name (an input trip, a replay that did not reproduce) keeps the
    first run's finding, saying why: a skipped step is never re-run."""
    trip.unreached = trip.check == Check.LOSS and auditor.hooks.tap.record.skipped
    finding = first_run_finding(trip)
    finding.element = finding.element or trip.element   # a sharded tensor's bad element
    if not trip.needs_rerun:
        return finding
    # Under torchrun every rank has the trip (the one exchange gave them the same verdict),
    # gets the origin's replay and skips.
    replay, localized = localize_in_process(auditor, options, trip, auditor.timeline)
    if localized is not None:
        localized = adopt(localized, trip)
        return _linked(auditor, localized, trip, replay.precision if replay else None)
    why = (replay.note if replay is not None and replay.note else
           "the batch was non-finite before the model got it: only a re-run traces the data "
           "code that made it" if trip.check == Check.INPUT else "the step was not replayed")
    finding.explain(f"not localized: {why} (a step the run skipped and went on from is never "
                    f"re-run)")
    return _linked(auditor, finding, trip, None)


def _linked(auditor: Any, finding: Finding, trip: ScriptTrip, precision: str | None) -> Finding:
    """A bad step's finding with the early warnings before it linked, as the first finding's
    are at the run's end (one optimizer's timeline only): every bad step of a run that grew
    until it overflowed is told the same way (divergence), not only the first."""
    if auditor.optimizer_count == 1:
        link_warnings(finding, auditor.warnings_so_far(trip.step), precision or "unknown",
                      trip.optimizer, auditor.ledger.clips)
    return finding


def adopt(finding: Finding, trip: ScriptTrip) -> Finding:
    """The replay's finding, with what only the first run knew (the rank, the step's notes)."""
    finding.rank = trip.rank if trip.rank is not None else finding.rank    # DDP: the replay's
    finding.tensors = finding.tensors or trip.tensors
    for note in trip_notes(trip):
        finding.explain(note)
    return finding


def _window(auditor: Any, options: ScriptOptions, trip: ScriptTrip) -> list[ModelCall]:
    replay_allowed(options)
    record = auditor.hooks.tap.record
    calls, code = record.calls, record.code_window
    if not calls and code is not None and (code.code.roots or code.code.overflowed
                                           or code.skipped):
        calls = [code]              # a step that called no module: its code alone
    if not calls:
        raise NotReplayable(f"no model call was heard in step {trip.step}")
    for call in calls:
        replayable(call)
    return calls


def window_params(auditor: Any, calls: list[ModelCall]) -> list[torch.nn.Parameter]:
    """The parameters whose gradients a replay of `calls` may write: the called modules' and
    every stepped optimizer's (the loss code may call another model, a GAN's critic, whose
    gradients the replay's backward would otherwise add to those the run left); for a step
    that called no module, every leaf its code read that requires grad (a raw tensor trained by
    hand, or by no optimizer)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for call in calls:
        for p in call.module.parameters():
            seen.setdefault(id(p), p)
        if not call.model_called:
            for op in call.code.ops:
                for t in tree_flatten((op.args, op.kwargs))[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
                        seen.setdefault(id(t), t)  # type: ignore[arg-type]
    for optimizer in auditor.ledger.stepped.values():
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def replay_tracer(auditor: Any, calls: list[ModelCall]) -> OpTracer:
    """The tracer of a replay of `calls`, naming the modules the script holds besides the
    window's model (learned when the trip was made: trip_namer.py, step_checks.raised)."""
    return OpTracer(local_module(calls[0].module), auditor.ledger.tracer_names(),
                    LedgerWeights(auditor.ledger, auditor.log.first_norms))


def _replayed(auditor: Any, calls: list[ModelCall], trip: ScriptTrip,
              timeline: Any) -> tuple[Finding | None, int, str | None]:
    """(the finding or None, the ops traced, the creating op's precision or why not)."""
    params = window_params(auditor, calls)
    skipped = auditor.hooks.tap.skipped_loss() if trip.unreached else None
    with auditor.hooks.muted(), auditor.hooks.tap.record.replaying(params) as writable, \
            torch.enable_grad():
        tracer = replay_tracer(auditor, calls)
        # One map for the window: a call that takes an earlier call's output (a recurrent
        # state passed from call to call, a seq2seq decoder's hidden) takes the replay's.
        env: dict[int, torch.Tensor] = {}
        # A loss trip is walked back from the first non-finite loss, made in forward: the
        # backward after it and the micro-batches after it made nothing earlier, and tracing
        # them costs several steps on a large model (every op after the value goes bad reads
        # its tensors' kinds). Ranks that replay together run it all: their collectives do.
        stop = trip.check == Check.LOSS and not replayed_together(auditor.ranks)
        try:
            with tracer:
                pairs, ends = [], []     # ends: the tracer's events after each call
                for i, call in enumerate(calls):
                    pairs += replay_call(tracer, call, skipped if i == len(calls) - 1 else None,
                                         env, stop_at_bad_loss=stop, writable=writable)
                    ends.append(len(tracer.trace.events))
                    if stop and not all(map(_finite, (again for _, again in pairs))):
                        break
        except NotReplayable:
            raise
        except Exception as exc:      # the replay of the script's own code raised
            raise NotReplayable(f"the in-process replay raised {type(exc).__name__}: "
                                f"{str(exc)[:200]}") from None
        ops = tracer.trace.ops_seen
        compiled = find_compiled(calls[0].entry) or find_compiled(calls[0].module)
        mismatch = loss_mismatch(pairs)
        if mismatch is not None and compiled is not None:
            mismatch = (f"{mismatch}; the model is compiled ({compiled.backend_name}) and was "
                        f"replayed eagerly: a value only the compiled program makes is named by "
                        f"the re-run's compiled replay")
        if mismatch is not None:
            return None, ops, mismatch
        named = _named(auditor, tracer, (calls, ends), pairs, params, trip, timeline, ops)
        if named[0] is not None and compiled is not None:   # the eager replay reproduced it
            named[0].compiled = CompiledReplay(compiled.backend_name, CompiledOutcome.EAGER)
        return named


def replay_call(tracer: OpTracer, call: ModelCall, skipped: torch.Tensor | None,
                env: dict[int, torch.Tensor] | None = None, forward: bool = True,
                stop_at_bad_loss: bool = False,
                writable: frozenset = frozenset()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replay one micro-batch; [(the first run's loss, the replay's)]. `env`, when given, is
    filled with the replay's tensor for each the first run's model and loss code made (by id).
    `forward` False: the loss code alone, from the model's output as the first run recorded it
    (detached: a value it held came from outside the replayed ops). `stop_at_bad_loss`: no
    backward after a replayed loss that is non-finite. `writable`: loss_code.replay's."""
    env = {} if env is None else env
    for frozen in call.before:      # a teacher's call, and its code, before this one
        replay_call(tracer, frozen, None, env)
    call.seed_replay()

    def at(where: tuple[str, int, str] | None, module: Any = None) -> None:
        REPLAYED_LINE.set(_line(where))
        REPLAYED_MODULE.set(module)

    def swap(value: Any) -> Any:
        return env.get(id(value), value) if isinstance(value, torch.Tensor) else value
    try:
        at(call.where)          # the script's model call: the line of a torch module's ops
        with autocast(call.autocast), torch.set_grad_enabled(call.trains):
            # `_call_impl`: the module's own forward and hooks, eagerly also when the script
            # compiled it (`module.compile()` calls its compiled code from `__call__`).
            output = (local_call(call.module, call.trains)(*tree_map(swap, call.args),
                                                           **tree_map(swap, call.kwargs))
                      if forward and call.model_called else tree_map(_recorded, call.output))
        env.update({id(a): b for a, b in zip(tree_flatten(call.output)[0],
                                             tree_flatten(output)[0])
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)})
        replay(call.code, env, at, writable)
    finally:
        REPLAYED_LINE.set(None)
        REPLAYED_MODULE.set(None)
    losses = call.losses + ([skipped] if skipped is not None else [])
    pairs = []
    for loss in losses:
        if id(loss) not in env:
            raise NotReplayable("a loss the recorded code did not make reached backward")
        pairs.append((loss, env[id(loss)]))
    if stop_at_bad_loss and not all(_finite(again) for _, again in pairs):
        return pairs
    for func, args, kwargs in call.code.roots:
        tracer.start_backward()
        try:
            local_backward(call.module, func)(*tree_map(swap, args), **tree_map(swap, kwargs))
        finally:
            tracer.end_backward()
    return pairs


def _finite(loss: torch.Tensor) -> bool:
    return math.isfinite(float(loss.detach()))


def _recorded(value: Any) -> Any:
    """A tensor of the model's recorded output as the loss code's replay starts from it."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def _line(where: tuple[str, int, str] | None) -> SourceLine | None:
    """The user's line a recorded op was called from, as the tracer names a line."""
    if where is None:
        return None
    file, line, function = where
    return SourceLine(file, line, linecache.getline(file, line).strip(), function)


def _named(auditor: Any, tracer: OpTracer, window: tuple[list[ModelCall], list[int]],
           pairs: list[tuple[torch.Tensor, torch.Tensor]], params: list, trip: ScriptTrip,
           timeline: Any, ops: int) -> tuple[Finding | None, int, str | None]:
    """Walk back from the replay's bad loss (or gradients) to the op that made it; `window`:
    the replayed calls and the tracer's event count after each (code_batch.window_place)."""
    calls, ends = window
    names: list[str] = []
    if trip.in_buffers:
        # Buffers the replayed forward made non-finite: walked back from the first bad one.
        bad = auditor.buffers.nonfinite()
        if not bad:
            return None, ops, "the in-process replay's buffers came out finite"
        names = [n for n, _ in bad]
        loc = walk_from_sink(tracer.trace, bad[0][1], Where.FORWARD, timeline, names,
                             f"the buffer {names[0]}")
    elif trip.check == Check.LOSS:
        sinks = [again for _first, again in pairs if not math.isfinite(float(again.detach()))]
        if not sinks:
            return None, ops, "the in-process replay's losses came out finite"
        loc = walk_from_sink(tracer.trace, sinks[0], Where.FORWARD, timeline, None)
    else:
        bad = [(auditor.parameter_name(p), p.grad) for p in params
               if p.grad is not None and kinds_of(p.grad)]
        bad.sort(key=lambda nb: trip.tensors.index(nb[0]) if nb[0] in trip.tensors
                 else len(trip.tensors))
        # A check that read no parameter's own gradient names none (DeepSpeed ZeRO reads its
        # flat partitions): any of the replay's is the trip's.
        if not bad or (trip.tensors and not set(trip.tensors) & {n for n, _ in bad}):
            return None, ops, "the in-process replay's gradients came out finite"
        names = [n for n, _ in bad]
        sink = own_gradient(auditor.ranks, bad[0][1])    # FSDP2: before the reduce-scatter
        if sink is None:
            return None, ops, "this rank's own gradients came out finite in the replay"
        loc = walk_from_sink(tracer.trace, sink, Where.BACKWARD, timeline, names)
    if not loc.reproduced or loc.event is None or not made_on_this_rank(auditor.ranks, loc):
        return None, ops, "the in-process replay named no op that made the value"
    before = made_before_window(tracer, loc, [*(b for c in calls for b in c.before), *calls],
                                trip.step)
    if before is not None:
        raise MadeBefore(before, ops)
    batch, found_micro = window_place(calls, ends, loc.event.index)
    found = batch.told(finding_at(tracer, loc, trip.step, names, batch.size))
    found.micro_batch = found_micro
    found.element = found.element or trip.element    # this rank's own, before any gather
    return found, ops, event_precision(loc.event)
