"""Where an infinity was made, and the words that say so.

The walk back from the sink stops at the op that created the sink's kind of value. A NaN made
from infinities (inf * 0 in a norm, inf - inf in a softmax) is only where the trouble showed:
the walk goes on along every infinite input to where that infinity was made, whatever the dtype,
and classifies the maker:
  computed  a traced op made it from finite inputs; its rule (exp-overflow, pole, log-domain,
            dtype-overflow only when the result can exceed the range, ...) names the cause;
  written   an op wrote it on purpose from a non-finite Python number (masked_fill, full,
            fill_, where, `x + float('-inf')`): the cause comes from the op that consumed it
            (a softmax or logsumexp over a row of nothing but -inf: softmax-all-masked);
  outside   no traced op made it (numpy in an autograd.Function, a C extension, .item()
            round trips, constants): cause unknown, "created outside torch ops".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nanaudit.localize.diagnose import infinity_reason
from nanaudit.localize.events import ForwardRecord, OpEvent, Trace, signed
from nanaudit.localize.ops import dtype_name, named_tensors, op_base
from nanaudit.localize.rules.registry import Reason
from nanaudit.report.vocabulary import Cause, Where

# Causes that name no source: the walk looks further for one that does.
SPECIFIC_EXCLUDED = (Cause.UNKNOWN, Cause.INF_ARITHMETIC)
# Ops that write a given value (rather than compute with it): a non-finite Python number there
# is a deliberate infinity, a mask or a log-space initial state.
WRITES = {"full", "full_like", "new_full", "fill", "masked_fill", "index_fill", "where",
          "scalar_tensor", "constant_pad_nd", "index_put", "scatter", "masked_scatter", "clamp",
          "clamp_min", "clamp_max", "fill_diagonal", "new_empty", "empty"}


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
        """Does the maker's rule name a cause of its own (not unknown, not inf arithmetic)?"""
        return (self.how == "computed" and self.reason is not None
                and self.reason.cause not in SPECIFIC_EXCLUDED)


class InfinitySources:
    """Finds and classifies the makers of the infinities an op received."""

    def __init__(self, trace: Trace, timeline: Any) -> None:
        self.trace, self.timeline = trace, timeline

    def classify(self, event: OpEvent, chain: list) -> Source:
        """How `event`, the first op of `chain` to hold the infinity, came by it."""
        untracked = [i for i, p in event.infinite_inputs() if p is None]
        if untracked:
            return Source("outside", event, chain, origin=event.untracked.get(untracked[0]))
        users_code = event.phase == Where.FORWARD or event.function is not None
        if users_code and event.scalar_infinities():
            return Source("written", event, chain)
        if users_code and event.scalar_overflows():
            return Source("outside", event, chain, origin=host_number(event))
        return Source("computed", event, chain, infinity_reason(event, self.timeline,
                                                              self.trace.weights))

    def of_producer(self, producer: int) -> Source:
        """The maker of the infinity the event `producer` handed on."""
        event, chain = self.trace.walk_back(producer, "inf")
        return self.classify(event, chain)

    def of_nan(self, creator: OpEvent) -> list[Source]:
        """The makers of every infinity an op that made NaN received, Python numbers included."""
        sources = []
        for _, producer in creator.infinite_inputs():
            if producer is None:
                sources.append(Source("outside", creator, [],
                                      origin=next(iter(creator.untracked.values()), None)))
            else:
                sources.append(self.of_producer(producer))
        if creator.scalar_infinities():
            sources.append(Source("written", creator, []))
        if creator.scalar_overflows():
            sources.append(Source("outside", creator, [], origin=host_number(creator)))
        return sources

    def of_forward(self, forward: ForwardRecord) -> list[Source]:
        """The makers of the infinities a backward op's forward op received."""
        if forward.event is not None:
            event = self.trace.events[forward.event]
            return [self.of_producer(p) if p is not None else
                    Source("outside", event, [event], origin=event.untracked.get(i))
                    for i, p in event.infinite_inputs()]
        return [self.of_producer(p) for p in forward.in_producers
                if p is not None and self.trace.events[p].out_kinds & {"inf", "-inf"}]


# --- words ---------------------------------------------------------------------------------------

def line_of(event: OpEvent | ForwardRecord) -> str:
    """` in model.norm (modeling_llama.py:65)`: where an op ran, for explanations."""
    src = event.source
    module = f" in {event.module}" if event.module else ""
    at = f" ({os.path.basename(src.file)}:{src.line})" if src is not None else ""
    return module + at


def describe(source: Source) -> str:
    """Where an infinity came from, as a phrase (`masked_fill in model (m.py:3), which ...`)."""
    event, base = source.event, op_base(source.event.op)
    if source.how == "written":
        values = ", ".join(sorted({scalar_word(v) for v in event.scalar_infinities()}))
        if base in WRITES:
            return f"{base}{line_of(event)}, which wrote {values} on purpose (a Python constant)"
        return (f"the Python number {values} given to {base}{line_of(event)} (a constant, or "
                f"a value computed outside torch ops, e.g. through .item())")
    if source.how == "outside":
        return (f"outside torch ops ({source.origin or 'an untraced tensor'}, first seen by "
                f"{base}{line_of(event)})")
    reason = f": {source.reason.text}" if source.reason is not None else ""
    return f"{base}{line_of(event)}{reason}"


def host_number(event: OpEvent) -> str:
    """The Python numbers an op got that its dtype cannot hold, as an origin."""
    values = ", ".join(f"{v:.4g}" for v in event.scalar_overflows())
    dtype = next((t.dtype for _, t in named_tensors(event.arg_names, event.args, event.kwargs)
                  if t.is_floating_point()), None)
    kind = dtype_name(dtype) if dtype is not None else "the op's dtype"
    return (f"the Python number {values} given to {op_base(event.op)}{line_of(event)}, beyond "
            f"the range of {kind} (a value computed on the host, e.g. through .item())")


def scalar_word(v: float) -> str:
    return "-inf" if v == float("-inf") else ("inf" if v == float("inf") else "nan")


def how_nan(event: OpEvent, lead: bool = False) -> str:
    """How `event` turned an infinity into NaN: a sentence (`lead`) or a clause to append."""
    base = op_base(event.op)
    how = nan_arithmetic(event)
    if lead:
        return f"{base}{line_of(event)} turned an infinity into NaN: {how}"
    return f"; the infinity then reached {base}{line_of(event)}, which computed {how}"


def passed_through(events: Iterable[OpEvent]) -> list[str]:
    """The ops' base names, each once, in order."""
    seen: list[str] = []
    for base in (op_base(e.op) for e in events):
        if base not in seen:
            seen.append(base)
    return seen


def weighted_by_its_input(log: OpEvent, nan_maker: OpEvent | None) -> bool:
    """Whether `nan_maker` multiplied `log`'s -inf by the log's own input: p * log(p), an
    entropy written by hand, NaN wherever p is 0."""
    if (nan_maker is None or op_base(nan_maker.op) != "mul" or not log.args
            or op_base(log.op) not in ("log", "log2", "log10")):
        return False
    x = log.args[0]
    return any(t is x or (t.data_ptr() == x.data_ptr() and t.shape == x.shape
                          and t.stride() == x.stride())
               for _, t in named_tensors(nan_maker.arg_names, nan_maker.args, nan_maker.kwargs))


# The fix for p * log(p): `xlogy(p, p)` and `special.entr(p)` are 0 at p = 0 in forward, but
# their backward is still NaN there (checked on torch 2.13), so they are not offered.
ENTROPY_FIX = ("an entropy written as p * log(p) is NaN wherever p is 0: take log p from the "
               "logits, `-(p * F.log_softmax(logits, -1)).sum(-1)` or "
               "`Categorical(logits=logits).entropy()`, or clamp p inside the log "
               "(`torch.log(p.clamp(min=1e-12))`); `torch.xlogy(p, p)` and "
               "`torch.special.entr(p)` are finite at p = 0 but their gradients are not")


# The fix for a mask's infinity that reached the loss (a written one no later op masked out).
WRITTEN_INFINITY_FIX = ("keep the mask's infinity out of what reaches the loss: fill with a "
                        "large finite value instead (`torch.finfo(x.dtype).min` for -inf), or "
                        "leave the masked entries out of every reduction the loss takes "
                        "(`cross_entropy`'s `label_smoothing` averages the log-probabilities of "
                        "every class, masked ones too, as does a mean of `log_softmax` over "
                        "the classes)")


def nan_arithmetic(event: OpEvent) -> str:
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
