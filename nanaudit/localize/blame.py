"""Which op a finding names, and why: the decisions of the walk back once it reached the op that
created the sink's kind of value.

The creator is blamed only when its own inputs explain what it made. A NaN made from infinities
is followed to where each infinity was made (infinities.py), and the maker is blamed when its rule
names a cause; a deliberate -inf is blamed on the softmax that reduced a row of nothing but -inf;
a NaN made by a built-in gradient is explained by its forward op (and an infinity that op
received or made and that was masked away: pytorch issue 4132); a value no traced op computed is
"created outside torch ops", never dressed up as an overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.causes import fix_for
from nanaudit.localize.diagnose import Diagnosis, as_diagnosis, diagnose, masked_gradient
from nanaudit.localize.events import OpEvent, Trace, carries, signed
from nanaudit.localize.infinities import (
    ENTROPY_FIX,
    SPECIFIC_EXCLUDED,
    WRITES,
    WRITTEN_INFINITY_FIX,
    InfinitySources,
    Source,
    describe,
    how_nan,
    line_of,
    passed_through,
    scalar_word,
    weighted_by_its_input,
)
from nanaudit.localize.ops import dtype_name, op_base
from nanaudit.localize.rules.registry import Reason, domain_reason
from nanaudit.report.vocabulary import Cause, Where

OUTSIDE_FIX = ("check the code that produced this tensor outside torch (the autograd.Function's "
               "forward, the numpy or C code): guard its result with `torch.isfinite`, or compute "
               "it with torch ops so it can be traced")


@dataclass
class Blame:
    """The op a finding names, the chain from it to the sink, and why."""

    event: OpEvent            # the op the finding names
    chain: list               # the events from it to the op that reached the sink
    diagnosis: Diagnosis


class Blamer:
    """Blames the op that created a bad value, or the op upstream that explains it."""

    def __init__(self, trace: Trace, timeline: Any, reached: str | None = None) -> None:
        self.trace, self.timeline = trace, timeline
        self.sources = InfinitySources(trace, timeline)
        self.reached = reached
        self.by_source = SourceBlame(trace, reached)

    def diagnose(self, event: OpEvent, kind: str) -> Diagnosis:
        """diagnose.diagnose with the run's history: its timeline, who updated the weights."""
        return diagnose(event, kind, self.timeline, self.trace.weights)

    def blame(self, creator: OpEvent, chain: list, kind: str) -> Blame:
        """`creator` made the sink's `kind` of value ('nan' or 'inf'); `chain` leads to the sink."""
        untracked = [i for i, (k, p) in enumerate(zip(creator.in_kinds, creator.in_producers))
                     if p is None and carries(k, kind)]
        if untracked:               # the value reached its first traced op already bad
            source = Source("outside", creator, [creator],
                            origin=creator.untracked.get(untracked[0]))
            return self.by_source.of(source, chain[1:], None) or \
                blame_outside(source, chain, signed(set().union(*creator.in_kinds)))
        if creator.phase == Where.BACKWARD and creator.function is None:
            # a built-in gradient: explained by its forward op and that op's inputs. The ops of
            # a custom Function's backward are the user's own code, judged like forward ops.
            return self.gradient(creator, chain, kind)
        if kind == "nan":
            if creator.infinite_inputs() or creator.scalar_infinities() \
                    or creator.scalar_overflows():
                return self.nan_from_infinity(creator, chain)
            if creator.phase == Where.FORWARD and chain[-1].phase == Where.BACKWARD:
                return self.masked_nan(creator, chain)
            return Blame(creator, chain, self.diagnose(creator, kind))
        source = self.sources.classify(creator, [creator])
        return self.by_source.of(source, chain[1:], None) or \
            self.unexplained_infinity(source, chain)

    def masked_nan(self, creator: OpEvent, chain: list) -> Blame:
        """A forward op made NaN that reached a gradient and not the loss (a gradient's walk
        runs through backward): the value was masked or indexed away in forward
        (`torch.where(d > 0, d.sqrt(), 0)`), and backward still ran through the op."""
        own = self.diagnose(creator, "nan")
        text = (f"in forward, {own.explanation}; that NaN was masked or indexed away "
                f"(`torch.where`, indexing), so the loss stayed finite, but backward still runs "
                f"through {op_base(creator.op)}, whose gradient read the NaN: a zero gradient "
                f"times NaN is NaN (pytorch issue 4132)")
        fix = fix_for(Cause.MASKED_NONFINITE_GRADIENT)
        if own.cause != Cause.UNKNOWN:
            fix += f"; or remove the {own.cause} at its source: {own.fix}"
        return Blame(creator, chain, Diagnosis(Cause.MASKED_NONFINITE_GRADIENT, text, fix,
                                               own.operand, own.mask))

    def nan_from_infinity(self, creator: OpEvent, chain: list) -> Blame:
        """`creator` made NaN of the infinities it received: blame their maker when it explains
        them, else the creator, saying where the infinity came from."""
        sources = self.sources.of_nan(creator)
        found = self.by_source.first_of(sources, chain, creator)
        if found is not None:
            return found
        own = self.diagnose(creator, "nan")
        source = sources[0]
        if source.how == "outside" and own.cause in SPECIFIC_EXCLUDED:
            return blame_outside(source, chain, "NaN")
        text = own.explanation
        if own.cause in SPECIFIC_EXCLUDED:
            text = how_nan(creator, lead=True) + f"; the infinity came from {describe(source)}"
        return Blame(creator, chain, Diagnosis(own.cause, text, own.fix))

    def unexplained_infinity(self, source: Source, chain: list) -> Blame:
        """An infinity no rule downstream of its maker explains reached the sink."""
        if source.how == "outside":
            return blame_outside(source, chain[1:] if chain and chain[0] is source.event
                                 else chain, signed(source.event.out_kinds))
        event = source.event
        if source.how == "written":
            written = op_base(event.op) in WRITES       # a mask, not a number from the host
            lead = "" if written else "created outside torch ops: "
            text = (f"{lead}{describe(source)}, and it reached "
                    f"{reached_words(chain, self.reached)} without being "
                    f"masked out again: no op along the way turned it back into a finite value")
            fix = WRITTEN_INFINITY_FIX if written else fix_for(Cause.UNKNOWN)
            return Blame(event, chain, Diagnosis(Cause.UNKNOWN, text, fix))
        return Blame(event, chain, as_diagnosis(source.reason) if source.reason is not None
                     else self.diagnose(event, "inf"))

    def gradient(self, creator: OpEvent, chain: list, kind: str) -> Blame:
        """A built-in gradient made the value: blame what its forward op received or made."""
        forward = creator.forward
        if forward is None:
            found = self._made_in_backward(creator, chain, kind)
            return found or Blame(creator, chain, self.diagnose(creator, kind))
        sources = self.sources.of_forward(forward)
        specific = next((s for s in sources if s.specific), None)
        if specific is not None and specific.reason is not None:
            hop = [self.trace.events[forward.event]] if forward.event is not None else []
            text = (self.by_source.reason_text(specific.reason) + f"; in forward the infinity "
                    f"reached {op_base(forward.op)}{line_of(creator)}, and in backward "
                    f"{op_base(creator.op)} (the gradient of {op_base(forward.op)}) turned "
                    f"it into {'NaN' if kind == 'nan' else kind}")
            return Blame(specific.event, specific.chain + hop + chain,
                         plain_rng(as_diagnosis(specific.reason, text)))
        found = self._made_in_backward(creator, chain, kind)
        if found is not None:
            return found
        reason = domain_reason(forward.func or forward.op, forward.args, forward.kwargs,
                               Where.FORWARD)
        if sources and reason is not None and reason.cause == Cause.SOFTMAX_ALL_MASKED:
            text = (reason.text + f"; the -inf came from {describe(sources[0])}, and "
                    f"the backward of {op_base(forward.op)} computed {op_base(creator.op)} "
                    f"of it: exp(-inf - (-inf)) = NaN")
            return Blame(creator, chain, as_diagnosis(reason, text))
        if forward.out_kinds:
            origin = None
            if sources and (reason is None or reason.cause in SPECIFIC_EXCLUDED):
                origin = f"its input held an infinity from {describe(sources[0])}"
            return Blame(creator, chain, masked_gradient(creator, forward, reason, origin))
        return Blame(creator, chain, self.diagnose(creator, kind))

    def _made_in_backward(self, creator: OpEvent, chain: list, kind: str) -> Blame | None:
        """An infinity made in backward itself (SqrtBackward's 1/0) and turned into NaN there;
        one made in forward and carried in through saved tensors is the masked case."""
        if kind != "nan" or not (creator.infinite_inputs() or creator.scalar_infinities()):
            return None
        sources = [s for s in self.sources.of_nan(creator)
                   if s.event.phase == Where.BACKWARD and s.specific]
        return self.by_source.first_of(sources, chain, creator)


class SourceBlame:
    """Blames the maker of an infinity when its rule names a cause, or the op that consumed a
    deliberate -inf when a masked-row rule explains it."""

    def __init__(self, trace: Trace, reached: str | None = None):
        self.trace, self.reached = trace, reached

    def first_of(self, sources: list, downstream: list, nan_maker: Any) -> Blame | None:
        """The blame of the first source that explains itself, sources with a cause first."""
        for source in sorted(sources, key=lambda s: not s.specific):
            found = self.of(source, downstream, nan_maker)
            if found is not None:
                return found
        return None

    def of(self, source: Source, downstream: list, nan_maker: Any) -> Blame | None:
        """`downstream` leads from the source's chain to the sink; `nan_maker` is the op that
        turned the infinity into NaN (None when the sink holds the infinity itself)."""
        if source.specific and source.reason is not None:
            text = self.reason_text(source.reason) + _onward(source, downstream, nan_maker,
                                                              self.reached)
            reason = source.reason
            if weighted_by_its_input(source.event, nan_maker):
                reason = reason._replace(fix=ENTROPY_FIX)
            return Blame(source.event, source.chain + downstream,
                         plain_rng(as_diagnosis(reason, text)))
        if source.how in ("written", "outside") or (source.reason is None
                                                    or source.reason.cause == Cause.UNKNOWN):
            # a writer is not its own consumer; an op that first saw an outside value may be
            path = (source.chain if source.how == "outside" else source.chain[1:]) + downstream
            found = masked_consumer(path)
            if found is not None:
                index, event, reason = found
                text = reason.text + f"; the -inf came from {describe(source)}"
                if nan_maker is not None and nan_maker is not event:
                    text += how_nan(nan_maker)
                return Blame(event, path[index:], as_diagnosis(reason, text))
        return None

    def reason_text(self, reason: Reason) -> str:
        return reason.text + origin_note(self.trace, reason)


def reached_words(chain: list, reached: str | None) -> str:
    """What the bad value reached, in words: `reached` when the caller named its sink (a
    buffer, the batch), else the loss or a gradient, by the phase of the chain's last op."""
    if reached is not None:
        return reached
    return "the loss" if chain[-1].phase == Where.FORWARD else "the gradient"


def _onward(source: Source, downstream: list, nan_maker: Any, reached: str | None) -> str:
    """How the infinity went on from its maker: to the op that made NaN of it, or to the sink."""
    if nan_maker is not None:
        return how_nan(nan_maker)
    if downstream:
        return (f"; the {signed(source.event.out_kinds)} reached "
                f"{reached_words(downstream, reached)} through "
                f"{', '.join(passed_through(downstream[:6]))}")
    return ""


def masked_consumer(events: list) -> tuple[int, OpEvent, Reason] | None:
    """The last softmax / log_softmax / logsumexp on the path whose row was all -inf."""
    found = None
    for index, event in enumerate(events):
        if event.phase != Where.FORWARD:
            break
        reason = domain_reason(event.func or event.op, event.args, event.kwargs, Where.FORWARD)
        if reason is not None and reason.cause == Cause.SOFTMAX_ALL_MASKED:
            found = (index, event, reason)
    return found


def blame_outside(source: Source, downstream: list, made: str) -> Blame:
    """A value no traced op computed: "created outside torch ops", never an overflow."""
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
    return Blame(event, chain, Diagnosis(Cause.UNKNOWN, text, OUTSIDE_FIX))


def plain_rng(diagnosis: Diagnosis) -> Diagnosis:
    """The diagnosis without its operand: the text already says where the value came from."""
    return Diagnosis(diagnosis.cause, diagnosis.explanation, diagnosis.fix)


def origin_note(trace: Trace, diagnosis: Any) -> str:
    """Where the value that hit an edge came from (`the 0 came from softplus ...`)."""
    operand, mask = diagnosis.operand, diagnosis.mask
    if operand is None or mask is None:
        return ""
    maker = trace.maker_of(operand)
    if maker is None:
        return ""
    try:
        values = operand.detach()[mask]
        shown = scalar_word(float(values[0])) if not torch.isfinite(values[0]) else \
            f"{float(values[0]):.6g}"
    except (IndexError, RuntimeError):
        return ""
    base = op_base(maker.op)
    text = f"; the value {shown} came from {base}{line_of(maker)}"
    inputs = [t for t in (maker.args or ()) if isinstance(t, torch.Tensor)
              and t.is_floating_point() and t.numel()]
    if inputs and base in ("softplus", "exp", "exp2", "sigmoid", "log_sigmoid"):
        low = float(inputs[0].detach().min())
        text += (f", whose input went down to {low:.4g}: {base} of a large negative number "
                 f"underflows to exactly {0 if base != 'log_sigmoid' else '-inf'} in "
                 f"{dtype_name(inputs[0].dtype)}")
    return text
