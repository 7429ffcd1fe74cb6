"""Replay the step that tripped a sentinel with full instruments and build the finding.

The replay restores the RNG state captured before the step and the model's buffers, runs
forward, loss and backward under the OpTracer, then walks back from the value that tripped (the
loss, or a parameter's gradient) to the op that created it. If the replay comes out finite the
finding says `reproduced: false` and names no op: a guess is never presented as the answer
(after Megatron's rerun state machine, which tells a transient fault from a bug the same way).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from nanaudit.localize.causes import fix_for
from nanaudit.localize.diagnose import (
    Diagnosis,
    Reason,
    as_diagnosis,
    diagnose,
    domain_reason,
    dtype_name,
    infinity_reason,
    masked_gradient,
    op_base,
    signed,
)
from nanaudit.localize.stats import tensor_stats
from nanaudit.localize.tracer import (
    OpEvent,
    OpTracer,
    Trace,
    carries,
    kinds_of,
    named_tensors,
    walk_back,
)
from nanaudit.run.checks import StepChecks, value_kind
from nanaudit.run.session import Session
from nanaudit.run.step import ReplayHooks, StepState, Trip


@contextlib.contextmanager
def preserved_buffers(model: torch.nn.Module):
    """Restore buffers (BatchNorm running stats) on exit, so replays stay comparable; yields
    the restore, for a caller that runs several replays from the same buffers."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    try:
        yield restore
    finally:
        restore()


@dataclass
class Localization:
    reproduced: bool
    kind: str | None = None               # the sink's value kind: nan, inf, -inf
    event: OpEvent | None = None          # the creating op
    chain: list | None = None             # creating op ... op that reached the sink
    diagnosis: Diagnosis | None = None
    bad_tensors: list | None = None       # parameter names with non-finite gradients
    ops_traced: int = 0


def traced_replay(session: Session, state: StepState) -> tuple[Trace, torch.Tensor]:
    """The step unit's replay of the tripping (micro-)step under the OpTracer."""
    with OpTracer(session.model) as tracer:
        loss = session.unit.replay(state, hooks=ReplayHooks(tracer.start_backward,
                                                            tracer.end_backward))
    return tracer.trace, loss


def replay_reproduces(session: Session, state: StepState, batch, check: str) -> bool:
    """An untraced replay on `batch`: does the same check trip again? (for sample isolation)

    An exception of the user's code is raised as their UserCodeError, never read as "does not
    reproduce": the sample search keeps sub-batches to sizes the model takes (samples.Feeding),
    so what is left is the user's to see."""
    loss = session.unit.replay(state, batch)
    if check == "loss":
        return not bool(torch.isfinite(loss.detach()))
    return not bool(torch.isfinite(StepChecks(session.model, session.device).grad_norm()))


def rows_the_model_needs(model: torch.nn.Module) -> tuple[int, str]:
    """The fewest rows a replay's batch must have for the model to take it, and why: BatchNorm
    in train mode needs more than one value per channel (a 1-row batch of (N, C) features
    raises). Other limits (a model that fixes its batch size) show as an exception, which the
    sample search answers by feeding the full batch size."""
    norms = [name or type(m).__name__ for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        shown = ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else "")
        return 2, (f"BatchNorm in train mode ({shown}) needs more than one value per channel")
    return 1, ""


def localize(session: Session, state: StepState, trip: Trip, timeline) -> Localization:
    with preserved_buffers(session.model):
        trace, loss = traced_replay(session, state)
    if trip.check == "loss":
        return walk_from_sink(trace, loss, "forward", timeline, None)
    bad = [(name, p) for name, p in session.model.named_parameters()
           if p.grad is not None and kinds_of(p.grad)]
    if not bad:
        return Localization(False, ops_traced=trace.ops_seen)
    return walk_from_sink(trace, bad[0][1].grad, "backward", timeline, [n for n, _ in bad])


def _last_event(trace: Trace, phase: str) -> int | None:
    for event in reversed(trace.events):
        if event.phase == phase:
            return event.index
    return trace.events[-1].index if trace.events else None


def walk_from_sink(trace: Trace, sink: torch.Tensor, phase: str, timeline, names) -> Localization:
    kinds = kinds_of(sink)
    if not kinds:
        return Localization(False, ops_traced=trace.ops_seen)
    value = value_kind(sink)
    start = trace.producer_of(sink)
    start = start if start is not None else _last_event(trace, phase)
    if start is None:
        return Localization(False, ops_traced=trace.ops_seen)
    kind = "nan" if "nan" in kinds else "inf"
    creator, chain = walk_back(trace, start, kind)
    blame = _Walk(trace, timeline).blame(creator, chain, kind)
    diagnosis = blame.diagnosis
    note = origin_note(trace, diagnosis)
    if note:
        diagnosis = Diagnosis(diagnosis.cause, diagnosis.explanation + note, diagnosis.fix)
    if blame.event.function is not None and \
            f"autograd.Function {blame.event.function}" not in diagnosis.explanation:
        where = f" ({os.path.basename(blame.event.source.file)}:{blame.event.source.line})" \
            if blame.event.source is not None else ""
        diagnosis = Diagnosis(diagnosis.cause, f"in the hand-written backward of the "
                              f"autograd.Function {blame.event.function}{where}: "
                              f"{diagnosis.explanation}", diagnosis.fix)
    return Localization(True, value, blame.event, blame.chain, diagnosis, names, trace.ops_seen)


# --- following infinities ---------------------------------------------------------------------
#
# The walk back from the sink stops at the op that created the sink's kind of value. A NaN made
# from infinities (inf * 0 in a norm, inf - inf in a softmax) is only where the trouble showed:
# the walk goes on along every infinite input to where that infinity was made, whatever the dtype,
# and classifies the maker:
#   computed  a traced op made it from finite inputs; its rule (exp-overflow, pole, log-domain,
#             dtype-overflow only when the result can exceed the range, ...) names the cause;
#   written   an op wrote it on purpose from a non-finite Python number (masked_fill, full,
#             fill_, where, `x + float('-inf')`): the cause comes from the op that consumed it
#             (a softmax or logsumexp over a row of nothing but -inf: softmax-all-masked);
#   outside   no traced op made it (numpy in an autograd.Function, a C extension, .item()
#             round trips, constants): cause unknown, "created outside torch ops".

SPECIFIC_EXCLUDED = ("unknown", "inf-arithmetic")
# Ops that write a given value (rather than compute with it): a non-finite Python number there
# is a deliberate infinity, a mask or a log-space initial state.
WRITES = {"full", "full_like", "new_full", "fill", "masked_fill", "index_fill", "where",
          "scalar_tensor", "constant_pad_nd", "index_put", "scatter", "masked_scatter", "clamp",
          "clamp_min", "clamp_max", "fill_diagonal", "new_empty", "empty"}


@dataclass
class Blame:
    event: OpEvent            # the op the finding names
    chain: list               # the events from it to the op that reached the sink
    diagnosis: Diagnosis


@dataclass
class Source:
    """Where an infinity came from: how, the op that made, wrote or first received it."""

    how: str                  # "computed" | "written" | "outside"
    event: OpEvent
    chain: list               # from `event` to the op that handed it on
    reason: Reason | None = None
    origin: str | None = None  # outside: what torch knows of the tensor's origin

    @property
    def specific(self) -> bool:
        return (self.how == "computed" and self.reason is not None
                and self.reason.cause not in SPECIFIC_EXCLUDED)


def _line(event) -> str:
    """` in model.norm (modeling_llama.py:65)`: where an op ran, for explanations."""
    src = event.source
    module = f" in {event.module}" if event.module else ""
    at = f" ({os.path.basename(src.file)}:{src.line})" if src is not None else ""
    return module + at


class _Walk:
    def __init__(self, trace: Trace, timeline):
        self.trace, self.timeline = trace, timeline

    def blame(self, creator: OpEvent, chain: list, kind: str) -> Blame:
        untracked = [i for i, (k, p) in enumerate(zip(creator.in_kinds, creator.in_producers))
                     if p is None and carries(k, kind)]
        if untracked:               # the value reached its first traced op already bad
            source = Source("outside", creator, [creator],
                            origin=creator.untracked.get(untracked[0]))
            return self._blame_source(source, chain[1:], None) or \
                self._outside(source, chain, signed(set().union(*creator.in_kinds)))
        if creator.phase == "backward" and creator.function is None:
            # a built-in gradient: explained by its forward op and that op's inputs. The ops of
            # a custom Function's backward are the user's own code, judged like forward ops.
            return self._backward(creator, chain, kind)
        if kind == "nan":
            if creator.infinite_inputs() or creator.scalar_infinities() \
                    or creator.scalar_overflows():
                return self._nan_from_infinity(creator, chain)
            return Blame(creator, chain, diagnose(creator, kind, self.timeline))
        source = self._classify(creator, [creator])
        return self._blame_source(source, chain[1:], None) or \
            self._unexplained_infinity(source, chain)

    # -- where an infinity was made --

    def _classify(self, event: OpEvent, chain: list) -> Source:
        untracked = [i for i, p in event.infinite_inputs() if p is None]
        if untracked:
            return Source("outside", event, chain, origin=event.untracked.get(untracked[0]))
        users_code = event.phase == "forward" or event.function is not None
        if users_code and event.scalar_infinities():
            return Source("written", event, chain)
        if users_code and event.scalar_overflows():
            return Source("outside", event, chain, origin=_host_number(event))
        return Source("computed", event, chain, infinity_reason(event, self.timeline))

    def _trace_infinity(self, producer: int) -> Source:
        event, chain = walk_back(self.trace, producer, "inf")
        return self._classify(event, chain)

    def _blame_source(self, source: Source, downstream: list, nan_maker) -> Blame | None:
        """Blame the maker of an infinity when its rule is specific, or the op that consumed a
        deliberate -inf when a masked-row rule explains it; None otherwise."""
        if source.specific:
            text = self._reason_text(source.reason) + self._onward(source, downstream, nan_maker)
            return Blame(source.event, source.chain + downstream,
                         plain_rng(as_diagnosis(source.reason, text)))
        if source.how in ("written", "outside") or (source.reason is None
                                                    or source.reason.cause == "unknown"):
            # a writer is not its own consumer; an op that first saw an outside value may be
            path = (source.chain if source.how == "outside" else source.chain[1:]) + downstream
            found = self._masked_consumer(path)
            if found is not None:
                index, event, reason = found
                rest = path[index:]
                text = reason.text + f"; the -inf came from {self._describe(source)}"
                if nan_maker is not None and nan_maker is not event:
                    text += self._how_nan(nan_maker)
                return Blame(event, rest, as_diagnosis(reason, text))
        return None

    def _masked_consumer(self, events: list):
        """The last softmax / log_softmax / logsumexp on the path whose row was all -inf."""
        found = None
        for index, event in enumerate(events):
            if event.phase != "forward":
                break
            reason = domain_reason(event.func or event.op, event.args, event.kwargs, "forward")
            if reason is not None and reason.cause == "softmax-all-masked":
                found = (index, event, reason)
        return found

    # -- NaN made from infinities --

    def _nan_from_infinity(self, creator: OpEvent, chain: list, only_phase: str | None = None):
        sources = []
        for _, producer in creator.infinite_inputs():
            if producer is None:
                sources.append(Source("outside", creator, [],
                                      origin=next(iter(creator.untracked.values()), None)))
            else:
                sources.append(self._trace_infinity(producer))
        if creator.scalar_infinities():
            sources.append(Source("written", creator, []))
        if creator.scalar_overflows():
            sources.append(Source("outside", creator, [], origin=_host_number(creator)))
        if only_phase is not None:
            sources = [s for s in sources if s.event.phase == only_phase and s.specific]
        for source in sorted(sources, key=lambda s: not s.specific):
            found = self._blame_source(source, chain, creator)
            if found is not None:
                return found
        if only_phase is not None:
            return None
        own = diagnose(creator, "nan", self.timeline)
        source = sources[0]
        if source.how == "outside" and own.cause in SPECIFIC_EXCLUDED:
            return self._outside(source, chain, "NaN")
        text = own.explanation
        if own.cause in SPECIFIC_EXCLUDED:
            text = self._how_nan(creator, lead=True) + f"; the infinity came from " \
                                                       f"{self._describe(source)}"
        return Blame(creator, chain, Diagnosis(own.cause, text, own.fix))

    def _unexplained_infinity(self, source: Source, chain: list) -> Blame:
        if source.how == "outside":
            return self._outside(source, chain[1:] if chain and chain[0] is source.event
                                 else chain, signed(source.event.out_kinds))
        event = source.event
        if source.how == "written":
            lead = "" if op_base(event.op) in WRITES else "created outside torch ops: "
            text = (f"{lead}{self._describe(source)}, and it reached the "
                    f"{'loss' if chain[-1].phase == 'forward' else 'gradient'} without being "
                    f"masked out again: no op along the way turned it back into a finite value")
            return Blame(event, chain, Diagnosis("unknown", text, fix_for("unknown")))
        return Blame(event, chain, as_diagnosis(source.reason) if source.reason is not None
                     else diagnose(event, "inf", self.timeline))

    def _outside(self, source: Source, downstream: list, made: str) -> Blame:
        event = source.event
        where = event.source
        at = (f" at {where.file}:{where.line} (in {where.function})" if where is not None else "")
        origin = source.origin or "a tensor no traced op produced"
        if source.origin is not None and source.origin.startswith("the Python number"):
            received = origin
        else:
            held = set().union(*event.in_kinds) if event.in_kinds else {made}
            received = (f"{op_base(event.op)} received {signed(held)} already in its input, "
                        f"from {origin}")
        text = (f"created outside torch ops: {received}{at}; "
                f"no torch op that nanaudit traced computed it (numpy or Python inside a custom "
                f"autograd.Function, a C extension, a value round-tripped through .item()), so "
                f"this is not an overflow of any op")
        chain = [event] + [e for e in downstream if e is not event]
        return Blame(event, chain, Diagnosis("unknown", text,
                                             "check the code that produced this tensor outside "
                                             "torch (the autograd.Function's forward, the numpy or "
                                             "C code): guard its result with `torch.isfinite`, or "
                                             "compute it with torch ops so it can be traced"))

    # -- NaN in backward made by an infinity in forward --

    def _backward(self, creator: OpEvent, chain: list, kind: str) -> Blame:
        forward = creator.forward
        sources = self._forward_sources(forward) if forward is not None else []
        fwd_event = self.trace.events[forward.event] if forward is not None \
            and forward.event is not None else None
        for source in sorted(sources, key=lambda s: not s.specific):
            if source.specific:
                hop = [fwd_event] if fwd_event is not None else []
                text = (self._reason_text(source.reason) + f"; in forward the infinity reached "
                        f"{op_base(forward.op)}{_line(creator)}, and in backward "
                        f"{op_base(creator.op)} (the gradient of {op_base(forward.op)}) turned "
                        f"it into {'NaN' if kind == 'nan' else kind}")
                return Blame(source.event, source.chain + hop + chain,
                             plain_rng(as_diagnosis(source.reason, text)))
        if kind == "nan" and (creator.infinite_inputs() or creator.scalar_infinities()):
            # an infinity made in backward itself (SqrtBackward's 1/0); one made in forward and
            # carried in through saved tensors is the masked case below
            found = self._nan_from_infinity(creator, chain, only_phase="backward")
            if found is not None:
                return found
        if sources:
            reason = domain_reason(forward.func or forward.op, forward.args, forward.kwargs,
                                   "forward")
            if reason is not None and reason.cause == "softmax-all-masked":
                text = (reason.text + f"; the -inf came from {self._describe(sources[0])}, and "
                        f"the backward of {op_base(forward.op)} computed {op_base(creator.op)} "
                        f"of it: exp(-inf - (-inf)) = NaN")
                return Blame(creator, chain, as_diagnosis(reason, text))
        if forward is not None and forward.out_kinds:
            reason = domain_reason(forward.func or forward.op, forward.args, forward.kwargs,
                                   "forward")
            origin = None
            if sources and (reason is None or reason.cause in SPECIFIC_EXCLUDED):
                origin = (f"its input held an infinity from {self._describe(sources[0])}")
            return Blame(creator, chain, masked_gradient(creator, forward, reason, origin))
        return Blame(creator, chain, diagnose(creator, kind, self.timeline))

    def _forward_sources(self, forward) -> list:
        if forward.event is not None:
            event = self.trace.events[forward.event]
            return [self._trace_infinity(p) if p is not None else
                    Source("outside", event, [event], origin=event.untracked.get(i))
                    for i, p in event.infinite_inputs()]
        return [self._trace_infinity(p) for p in forward.in_producers
                if p is not None and self.trace.events[p].out_kinds & {"inf", "-inf"}]

    # -- words --

    def _reason_text(self, reason: Reason) -> str:
        return reason.text + origin_note(self.trace, reason)

    def _describe(self, source: Source) -> str:
        event, base = source.event, op_base(source.event.op)
        if source.how == "written":
            values = ", ".join(sorted({_fmt_scalar(v) for v in event.scalar_infinities()}))
            if base in WRITES:
                return f"{base}{_line(event)}, which wrote {values} on purpose (a Python constant)"
            return (f"the Python number {values} given to {base}{_line(event)} (a constant, or "
                    f"a value computed outside torch ops, e.g. through .item())")
        if source.how == "outside":
            return (f"outside torch ops ({source.origin or 'an untraced tensor'}, first seen by "
                    f"{base}{_line(event)})")
        reason = f": {source.reason.text}" if source.reason is not None else ""
        return f"{base}{_line(event)}{reason}"

    def _onward(self, source: Source, downstream: list, nan_maker) -> str:
        if nan_maker is not None:
            return self._how_nan(nan_maker)
        if downstream:
            return (f"; the {signed(source.event.out_kinds)} reached the "
                    f"{'loss' if downstream[-1].phase == 'forward' else 'gradient'} through "
                    f"{', '.join(_unique(op_base(e.op) for e in downstream[:6]))}")
        return ""

    def _how_nan(self, event: OpEvent, lead: bool = False) -> str:
        base = op_base(event.op)
        how = _nan_arithmetic(event)
        if lead:
            return f"{base}{_line(event)} turned an infinity into NaN: {how}"
        return f"; the infinity then reached {base}{_line(event)}, which computed {how}"


def _host_number(event: OpEvent) -> str:
    values = ", ".join(f"{v:.4g}" for v in event.scalar_overflows())
    dtype = next((t.dtype for _, t in named_tensors(event.arg_names, event.args, event.kwargs)
                  if t.is_floating_point()), None)
    kind = dtype_name(dtype) if dtype is not None else "the op's dtype"
    return (f"the Python number {values} given to {op_base(event.op)}{_line(event)}, beyond the "
            f"range of {kind} (a value computed on the host, e.g. through .item())")


def plain_rng(diagnosis: Diagnosis) -> Diagnosis:
    """The diagnosis without its operand: the text already says where the value came from."""
    return Diagnosis(diagnosis.cause, diagnosis.explanation, diagnosis.fix)


def _fmt_scalar(v: float) -> str:
    return "-inf" if v == float("-inf") else ("inf" if v == float("inf") else "nan")


def _unique(items) -> list:
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _nan_arithmetic(event: OpEvent) -> str:
    """Which inf arithmetic made NaN at this op, from its inputs."""
    base = op_base(event.op)
    tensors = [t for _, t in named_tensors(event.arg_names, event.args, event.kwargs)]
    scalars = [a for a in list(event.args or ())[1:] if isinstance(a, (int, float))]
    signs = set().union(*event.in_kinds) if event.in_kinds else set()
    signs |= {"inf" if v > 0 else "-inf" for v in event.scalar_infinities() if v == v}
    if base == "mul":
        zero = any(bool((t == 0).any()) for t, k in zip(tensors, event.in_kinds)
                   if not k and t.is_floating_point()) or any(v == 0 for v in scalars)
        if zero or not any(not k for k in event.in_kinds):
            return f"{signed(signs - {'nan'})} * 0 = NaN"
    if base in ("add", "sub", "sum", "cumsum", "mean", "addmm", "mm", "bmm", "matmul", "linear"):
        if base in ("add", "sub"):
            return "inf - inf = NaN"
        return "a sum of +inf and -inf terms (or inf * 0 inside it) = NaN"
    if base in ("div", "true_divide"):
        return "inf / inf = NaN"
    if base in ("_softmax", "_log_softmax", "softmax", "log_softmax"):
        return "exp(x - max) with x = max = inf, inf - inf = NaN"
    if base in ("native_layer_norm", "layer_norm", "native_group_norm", "native_batch_norm",
                "_native_batch_norm_legit", "_fused_rms_norm", "rms_norm"):
        return "x - mean(x) = inf - inf and inf / sqrt(var = inf) = NaN"
    return "inf - inf, 0 * inf or inf / inf = NaN"


def origin_note(trace: Trace, diagnosis) -> str:
    """Where the value that hit an edge came from (`the 0 came from softplus ...`)."""
    operand, mask = diagnosis.operand, diagnosis.mask
    if operand is None or mask is None:
        return ""
    maker = trace.maker_of(operand)
    if maker is None:
        return ""
    try:
        values = operand.detach()[mask]
        shown = _fmt_scalar(float(values[0])) if not torch.isfinite(values[0]) else \
            f"{float(values[0]):.6g}"
    except (IndexError, RuntimeError):
        return ""
    base = op_base(maker.op)
    text = f"; the value {shown} came from {base}{_line(maker)}"
    inputs = [t for t in (maker.args or ()) if isinstance(t, torch.Tensor)
              and t.is_floating_point() and t.numel()]
    if inputs and base in ("softplus", "exp", "exp2", "sigmoid", "log_sigmoid"):
        low = float(inputs[0].detach().min())
        text += (f", whose input went down to {low:.4g}: {base} of a large negative number "
                 f"underflows to exactly {0 if base != 'log_sigmoid' else '-inf'} in "
                 f"{dtype_name(inputs[0].dtype)}")
    return text


def input_stats(event: OpEvent) -> list:
    return [tensor_stats(name, t) for name, t in named_tensors(event.arg_names, event.args,
                                                                event.kwargs)]


def forward_input_stats(event: OpEvent) -> list:
    record = event.forward
    if record is None or record.args is None:
        return []
    return [tensor_stats(name, t) for name, t in named_tensors(record.arg_names, record.args,
                                                                record.kwargs)]
