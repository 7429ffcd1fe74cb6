"""Turn what tripped a sentinel into a Finding: from what the check saw for input, parameter,
optimizer and schedule checks (built by first_finding.py, the one builder of every front end);
through a traced replay (localize) and a sample search for the loss and gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.errors import FindingInterrupted
from nanaudit.localize.compiled import step_phase
from nanaudit.localize.compiled_finding import replayed_compiled
from nanaudit.localize.events import OpEvent
from nanaudit.localize.first_finding import Seen, first_finding, short
from nanaudit.localize.ops import named_tensors
from nanaudit.localize.replay import (
    localize,
    preserved_buffers,
    replay_reproduces,
    rows_the_model_needs,
)
from nanaudit.localize.samples import IsolatedRows, SearchInterrupted, isolate_rows
from nanaudit.localize.stats import forward_input_stats, input_stats, tensor_stats
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.walk import Localization
from nanaudit.report.model import ChainLink, Finding, SampleRow, SampleSearch
from nanaudit.report.sections import CompiledReplay
from nanaudit.report.vocabulary import Cause, Check, CompiledOutcome, Where
from nanaudit.run.batch import (
    BatchLayout,
    float_leaves,
    infer_layout,
    nonfinite_rows,
    select_rows,
)
from nanaudit.run.checks import nonfinite_names, value_kind
from nanaudit.run.compiled import find_compiled, replay_eagerly
from nanaudit.run.names import user_named
from nanaudit.run.optimizer_state import explain_state
from nanaudit.run.session import Session
from nanaudit.run.step import ScanOutcome, StepState, Trip


def build_finding(session: Session, outcome: ScanOutcome, isolate_samples: bool = True,
                  localizer: Callable | None = None) -> Finding:
    """`localizer`: replays a loss or gradient trip (FSDP2: localize/sharded_replay.py)."""
    trip, state = outcome.trip, outcome.state
    if trip is None or state is None:
        raise ValueError("build_finding needs a tripped outcome (a trip and its step's state)")
    if trip.check == Check.INPUT:
        finding = input_finding(session, state)
    elif trip.check in (Check.PARAMETER, Check.OPTIMIZER):
        finding = state_finding(session, trip)
    elif trip.check == Check.SCHEDULE:
        finding = schedule_finding(session, trip)
    else:
        finding = localized_finding(session, state, trip, outcome.timeline, isolate_samples,
                                    localizer or localize)
    return with_position(finding, trip, state)


def with_position(finding: Finding, trip: Trip, state: StepState | None) -> Finding:
    """Where in the run the finding sits: the data index of its (micro-)batch, its place in
    an accumulation window, the optimizer and the named loss that tripped."""
    if state is not None and finding.batch_index is None:
        finding.batch_index = state.batch_index
        finding.micro_batch = state.micro_batch
    finding.micro_batch = finding.micro_batch if finding.micro_batch is not None \
        else trip.micro_batch
    finding.optimizer = finding.optimizer or trip.optimizer
    finding.loss_name = finding.loss_name or trip.loss_name
    return finding


MAX_LEAVES_SHOWN = 16


def input_finding(session: Session, state: StepState) -> Finding:
    layout = infer_layout(state.batch, session.options.batch_dim)
    bad = [(path, t) for path, t in float_leaves(state.batch) if not bool(torch.isfinite(t).all())]
    path, first = bad[0]
    rows = sorted({r for p, t in bad for r in nonfinite_rows(t, layout.dims.get(p))})
    # A batch of thousands of leaves must not make a report of thousands of tables.
    stats = [tensor_stats(f"batch{p}", t) for p, t in bad[:MAX_LEAVES_SHOWN]]
    counts = ", ".join(f"batch{p}: {s.nan} NaN, {s.posinf} +inf, {s.neginf} -inf"
                       for (p, _), s in zip(bad, stats))
    if len(bad) > MAX_LEAVES_SHOWN:
        counts += f", and {len(bad) - MAX_LEAVES_SHOWN} more leaves"
    row_text = f" in row(s) {short(rows)}" if layout.size else ""
    explanation = (f"the batch of step {state.step} holds non-finite values before the model runs "
                   f"({counts}){row_text}")
    return first_finding(Seen(state.step, Check.INPUT, value_kind(first), explanation,
                              tensors=[f"batch{p}" for p, _ in bad], tensor=f"batch{path}",
                              samples=rows if layout.size else None, inputs=stats,
                              sample_rows=sample_rows(state.batch, layout, rows)))


def state_finding(session: Session, trip: Trip) -> Finding:
    model = session.model
    named_params = list(user_named(model, model.named_parameters()))
    named_buffers = list(user_named(model, model.named_buffers()))
    params = nonfinite_names(named_params)
    buffers = nonfinite_names((n, b) for n, b in named_buffers if b.is_floating_point())
    names = params + buffers
    tensors = dict(named_params) | dict(named_buffers)
    value = value_kind(tensors[names[0]]) if names else "nan"
    stats = [tensor_stats(n, tensors[n]) for n in names[:8]]
    if trip.check == Check.OPTIMIZER and params:
        finding = first_finding(Seen(trip.step, trip.check, value,
                                     _optimizer_text(session, trip.step, params),
                                     tensors=names, tensor=params[0], inputs=stats))
        explain_state(finding, session.optimizers.values(), [tensors[n] for n in params],
                      session.param_names, trip.rank)
        return finding
    ckpt = session.options.checkpoint
    origin = (f"the checkpoint {ckpt}" if ckpt and trip.step == 0 and trip.check == Check.PARAMETER
              else "the model's state")
    when = "before step 0" if trip.check == Check.PARAMETER else f"after step {trip.step}"
    explanation = (f"{origin} holds non-finite values {when}: "
                   f"{short(names)}" + (" (buffers changed by forward, not by the optimizer)"
                                         if not params else ""))
    # Only buffers bad after an update: the forward changed them, not the optimizer.
    return first_finding(Seen(trip.step, trip.check, value, explanation, tensors=names,
                              inputs=stats, parameters=bool(params)))


def schedule_finding(session: Session, trip: Trip) -> Finding:
    """A learning rate no update may run with, caught before the update was applied."""
    names = [session.param_names.get(id(p), "?") for opt in session.optimizers.values()
             for g in opt.param_groups if not _lr_ok(g.get("lr")) for p in g["params"]]
    return first_finding(Seen(trip.step, Check.SCHEDULE, _lr_kind(trip.note or ""),
                              f"before the update of step {trip.step}: {trip.note}",
                              tensors=names, optimizer=trip.optimizer))


def _lr_ok(lr: Any) -> bool:
    try:
        value = float(lr)
    except (TypeError, ValueError):
        return True
    return value == value and abs(value) != float("inf") and value >= 0


def _lr_kind(note: str) -> str:
    """The finding's value kind for a bad lr: nan, inf, -inf, or `negative`."""
    value = note.split("lr=", 1)[1].split()[0] if note and "lr=" in note else "nan"
    return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(value, "negative")


def _optimizer_text(session: Session, step: int, names: list) -> str:
    optimizer = session.optimizer
    group = optimizer.param_groups[0] if optimizer is not None else {}
    hyper = ", ".join(f"{k}={group[k]}" for k in ("lr", "eps", "momentum", "weight_decay")
                      if k in group)
    text = (f"the gradients of step {step} were finite, but after "
            f"{type(optimizer).__name__}.step() the parameters {short(names)} hold non-finite "
            f"values ({hyper})")
    dtypes = {p.dtype for p in session.model.parameters()}
    eps = group.get("eps")
    for dtype in dtypes & {torch.float16, torch.bfloat16}:
        if isinstance(eps, float) and torch.tensor(eps, dtype=dtype).item() == 0:
            text += (f"; eps={eps} is 0 in {str(dtype).replace('torch.', '')}, so a zero second "
                     f"moment divides by zero")
    return text


def localized_finding(session: Session, state: StepState, trip: Trip, timeline: Any,
                      isolate_samples: bool, localizer: Callable = localize) -> Finding:
    loc = localizer(session, state, trip, timeline)
    compiled = find_compiled(session.model)
    if not loc.reproduced:
        finding = _not_reproduced(trip, own_step=session.step_fn is not None)
        if compiled is None:
            return finding
        return replayed_compiled(session, state, trip, compiled, finding)
    bad = loc.bad_tensors or []
    finding = traced_finding(loc, trip.step, tensor=bad[0] if trip.check == Check.GRADIENT and bad
                             else (None if trip.check == Check.GRADIENT else "loss"),
                             tensors=bad, loss_name=_loss_name(session))
    if compiled is not None:
        finding.compiled = CompiledReplay(compiled.backend_name, CompiledOutcome.EAGER)
    if trip.note:
        finding.explain(trip.note)
    if finding.cause == Cause.DIVERGENCE:
        finding.sample_search = SampleSearch(None, 0, False,
                                             "divergence: the weights, not particular rows")
    elif isolate_samples:
        _isolate(session, state, trip, finding)
    elif loc.rows:       # read off the traced op's output (FSDP2: no replays to search with)
        finding.samples, finding.sample_search = loc.rows, loc.sample_search
    return finding


def traced_finding(loc: Localization, step: int, tensor: str | None, tensors: list,
                   loss_name: str | None = None) -> Finding:
    """The finding of a reproduced localization, for every command that traces a step: the
    creating op (and its forward op), its module, line and inputs, the diagnosis, the chain.
    `loss_name`: what ops outside every module ran in (the loss callable), when known."""
    event = loc.event
    assert event is not None and loc.diagnosis is not None and loc.kind is not None, \
        "a reproduced localization"
    return Finding(
        step=step, where=Where(event.phase), value=loc.kind, cause=loc.diagnosis.cause,
        explanation=loc.diagnosis.explanation, fix=loc.diagnosis.fix, op=event.op,
        forward_op=event.forward.op if event.phase == Where.BACKWARD and event.forward else None,
        module=module_name(event, loss_name), source=event.source, inputs=input_stats(event),
        forward_inputs=forward_input_stats(event) if event.phase == Where.BACKWARD else [],
        reproduced=True, tensors=tensors, tensor=tensor, element=loc.element,
        chain=[_chain_link(e, loss_name) for e in loc.chain or []])


def made_by(tracer: OpTracer, events: set[int]) -> list[torch.Tensor]:
    """The bad tensors these events (by index) made, oldest first (the tracer keeps them)."""
    producer = tracer.trace.producer
    return [t for t in tracer.kept_tensors() if producer.get(id(t)) in events]


def event_precision(event: OpEvent) -> str:
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


def _loss_name(session: Session) -> str:
    """The loss callable as the config names it; under `Sentinel`, the function's own name."""
    target = session.loss_label
    fn = session.loss_fn if session.loss_fn is not None else session.step_fn
    # An integration's replay wrapper names the user's code it runs (`Model.training_step`).
    label = getattr(getattr(fn, "__self__", None), "loss_label", None)
    if label:
        return label
    qualname = getattr(fn, "__qualname__", None)
    if target.startswith("<") and qualname:
        return f"{getattr(fn, '__module__', None) or '?'}:{qualname}"
    return target


def module_name(event: OpEvent, loss_name: str | None) -> str | None:
    """The module an op ran in; ops outside every module's forward ran in the loss callable,
    named as the config names it (`train:compute_loss`), not as the root module."""
    if event.module is not None:
        return event.module
    if event.phase == Where.FORWARD or event.forward is not None:
        return loss_name
    return None


def _chain_link(event: OpEvent, loss_name: str | None) -> ChainLink:
    return ChainLink(op=event.op, where=event.phase, module=module_name(event, loss_name),
                     value=sorted(event.out_kinds),
                     line=event.source.line if event.source else None,
                     received=received_kinds(event))


def received_kinds(event: OpEvent) -> list[str]:
    """Each tensor input of a traced op with the non-finite kinds it carried in, in the order
    the tracer recorded them (the schema's, as `named_tensors` gives them)."""
    names = [name for name, _ in named_tensors(event.arg_names, event.args, event.kwargs)]
    if len(names) != len(event.in_kinds):
        names = [f"input {i}" for i in range(len(event.in_kinds))]
    return [f"{name}: {', '.join(sorted(kinds)) or 'finite'}"
            for name, kinds in zip(names, event.in_kinds)]


def _tripped(trip: Trip) -> tuple[str, str, Where]:
    """(what tripped, the kind of value it read, where) for a loss or gradient trip."""
    what = "loss" if trip.check == Check.LOSS else "gradients"
    value = trip.loss if trip.check == Check.LOSS else trip.grad_norm
    kind = "nan" if value != value else ("inf" if value and value > 0 else "-inf")
    return what, kind, step_phase(trip.check)


def _not_reproduced(trip: Trip, own_step: bool = False) -> Finding:
    """A replay that came out finite. With the user's own step, state the function keeps
    outside the model (a call counter deciding which optimizer steps, a cache) is the likelier
    reason: nanaudit restores the model, buffers, optimizers, schedulers and RNGs, not that."""
    what, kind, where = _tripped(trip)
    named = f" `{trip.loss_name}`" if trip.check == Check.LOSS and trip.loss_name else ""
    outside = ("state your step function keeps outside the model, which the replay does not "
               "restore (a call counter choosing which optimizers step, a cache, a generator "
               "of its own), or " if own_step else "")
    keep = ("keep the step's own state in the model (a buffer, or a `state_dict` / "
            "`load_state_dict` pair) so a replay starts where the run was; " if own_step else "")
    return Finding(
        step=trip.step, where=where, value=kind,
        cause=Cause.UNKNOWN, reproduced=False,
        explanation=(f"the sentinel saw {kind} in the {what}{named} at step {trip.step}, but "
                     f"replaying that step with the same batch, weights and RNG state gave "
                     f"finite values: {outside}a non-deterministic kernel or a transient fault "
                     f"(hardware, memory), not a reproducible bug in this step"),
        fix=(f"{keep}re-run the scan; if it recurs at other steps, set "
             "`torch.use_deterministic_algorithms(True)` or run on another device to rule out "
             "hardware"))


def unreplayed_finding(trip: Trip, how_to_replay: str) -> Finding:
    """A loss or gradient trip reported without a replay (nothing to replay it with)."""
    what, kind, _ = _tripped(trip)
    return first_finding(Seen(trip.step, trip.check, kind,
                              f"the {what} of step {trip.step} hold {kind}; {how_to_replay} "
                              f"to replay the step and name the op that created it"))


def _isolate(session: Session, state: StepState, trip: Trip, finding: Finding) -> None:
    layout = infer_layout(state.batch, session.options.batch_dim)
    if not layout.size or layout.size < 2:
        finding.sample_search = SampleSearch(layout.size, 0, False, "no batch dimension to search")
        if layout.size == 1:
            finding.samples = [0]
        return

    min_rows, why = rows_the_model_needs(session.model)

    def reproduces(rows: list[int]) -> bool:
        sub = select_rows(state.batch, layout, rows)
        restore_buffers()      # each replay starts from the same buffers (running stats)
        return replay_reproduces(session, state, sub, trip.check)

    try:      # eager, as the traced replay: sub-batches would recompile a compiled model
        with preserved_buffers(session.model) as restore_buffers, replay_eagerly():
            search = isolate_rows(reproduces, layout.size, session.options.localize.max_replays,
                                  min_rows=min_rows, min_reason=why)
    except SearchInterrupted as stop:
        _record_search(finding, state, layout, stop.search)
        raise FindingInterrupted(finding) from stop
    _record_search(finding, state, layout, search)


def _record_search(finding: Finding, state: StepState, layout: BatchLayout,
                   search: IsolatedRows) -> None:
    finding.samples = search.samples
    finding.sample_search = SampleSearch(layout.size, search.replays, search.coupled,
                                         search.note)
    finding.sample_rows = sample_rows(state.batch, layout, search.samples or [])


def sample_rows(batch: Any, layout: BatchLayout, rows: list[int], limit: int = 8) -> list:
    """Each offending row's leaves: values when small, statistics when large; and its entries
    of the per-sample non-tensor leaves (ids, file names)."""
    from nanaudit.run.batch import row_values
    shown = []
    for row in rows[:limit]:
        leaves = []
        for path, t in (float_leaves(batch) + _int_leaves(batch))[:MAX_LEAVES_SHOWN]:
            dim = layout.dims.get(path)
            if dim is not None and row < t.shape[dim]:
                leaves.append((f"batch{path}", tensor_stats(f"batch{path}", t.select(dim, row))))
        values = tuple((f"batch{path}", value) for path, value in row_values(batch, layout, row))
        shown.append(SampleRow(row, tuple(leaves), values))
    return shown


def _int_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    from nanaudit.run.batch import tensor_leaves
    return [(p, t) for p, t in tensor_leaves(batch)
            if not (t.is_floating_point() or t.is_complex())]
